"""The conformance kit: what a driver must do, as pytest tests.

The core's own guards (bounds, rollback, the empty filter, splitting) are
tested once, in xferkit's suite, against ``xferkit.testing.mock``; this kit
runs your driver for real and checks what only a driver can get wrong.

Point it at a backend by subclassing in your plugin's tests::

    from xferkit.testing.conformance import BackendConformance

    class TestMyDriver(BackendConformance):
        backend = "mydriver"
        options = {"device": "lo"}

The tests use real memory (numpy buffers) and the reference model; they run
the driver for real, in this process (``inprocess``) and, when it claims
cross-process support, against a peer process (``crossprocess``).
``python -m xferkit.testing.conformance --table`` prints what each test
proves, from the tests' own docstrings (docs/plugins.md holds that table).
"""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from ..plugins import backends
from .crossprocess import CrossProcessConformance, peer_memory, peer_setup
from .inprocess import InProcessConformance
from .kit import (
    DST_SLOTS,
    REQUEST,
    SRC_SLOTS,
    drain_until,
    gdn_hybrid_specs,
    held,
)


class BackendConformance(InProcessConformance, CrossProcessConformance):
    """Subclass with ``backend`` (a registered backend name) and ``options``."""


def require_backend(name: str) -> None:
    """Skip the calling test module unless backend ``name`` is usable here, with the reason
    ``xferkit.backends()`` gives (the probe's own words: what to install)."""
    info = next((b for b in backends() if b.name == name), None)
    if info is None or not info.available:
        why = "no such backend is installed" if info is None else info.reason
        pytest.skip(f"backend {name!r} is not usable here: {why}", allow_module_level=True)


def obligations() -> list[tuple[str, str]]:
    """(test name, what it proves) for every kit test, in the order they run: the docstring's
    first paragraph."""
    out = []
    for part in (InProcessConformance, CrossProcessConformance):
        for name, func in vars(part).items():
            if not name.startswith("test_"):
                continue
            doc = inspect.getdoc(func) or ""
            first = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
            out.append((name, first))
    return out


def table() -> str:
    """The markdown table of ``obligations()``, as docs/plugins.md holds it."""
    rows = ["| test | what your driver must do |", "|---|---|"]
    rows += [f"| `{name}` | {text} |" for name, text in obligations()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m xferkit.testing.conformance", description="The conformance kit's tests."
    )
    parser.add_argument("--table", action="store_true", help="print the obligations table")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
    else:
        for name, _ in obligations():
            print(name)


__all__ = [
    "DST_SLOTS",
    "REQUEST",
    "SRC_SLOTS",
    "BackendConformance",
    "CrossProcessConformance",
    "InProcessConformance",
    "drain_until",
    "gdn_hybrid_specs",
    "held",
    "obligations",
    "peer_memory",
    "peer_setup",
    "require_backend",
    "table",
]

if __name__ == "__main__":
    main()
