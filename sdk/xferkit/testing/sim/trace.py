"""One line per call into a core, for ``--trace`` and the lines after a violation."""

from __future__ import annotations

from typing import Any

import msgspec


def _ints(v: Any) -> object:
    return int(v) if isinstance(v, int) else [int(i) for i in v]


def brief(args: tuple[Any, ...]) -> str:
    out = []
    for a in args:
        if hasattr(a, "use") and hasattr(a, "side"):  # an engine's handle
            out.append(f"<{a.side} {a.request_id} use {a.use.serial}>")
        elif isinstance(a, bytes) and len(a) > 24:
            out.append(f"<{len(a)} bytes>")
        elif isinstance(a, dict):  # slots per pool, or a skip's counts per pool
            out.append("{" + ", ".join(f"{k}: {_ints(v)}" for k, v in a.items()) + "}")
        elif isinstance(a, msgspec.Struct):
            out.append(type(a).__name__ + _fields(a))
        else:
            out.append(repr(a))
    return " ".join(out)


ADDRESSES = frozenset({"staging"})
"""Fields holding a memory address: another on every run, so a trace shows whether, not where."""


def _fields(msg: msgspec.Struct) -> str:
    keep = [
        f"{f}={'<address>' if v and f in ADDRESSES else repr(v)}"[:60]
        for f in msg.__struct_fields__
        if isinstance(v := getattr(msg, f), str | int | float | bool)
    ]
    return "(" + ", ".join(keep) + ")"
