"""Importing NIXL: the module that holds it, its logger on stderr, its agents, its errors."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from functools import cache
from types import ModuleType
from typing import Any

from xferkit.driver import CapabilityError, ProtocolError, TransferError, XferError


class _Stderr:
    """Whatever ``sys.stderr`` is at the time of writing (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout; move it to stderr (stdout may carry a protocol)."""
    for handler in logging.getLogger("nixl").handlers:
        # NIXL's dictConfig names its handler; other handlers (a test runner's) stay as they are.
        if handler.get_name() == "consoleHandler" and type(handler) is logging.StreamHandler:
            handler.setStream(_Stderr())  # type: ignore[arg-type]


WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
"""NIXL's compiled wheels, one per CUDA (or ROCm) major version."""


def wheel() -> str:
    """The module to import NIXL from: the one compiled wheel installed, else the meta package.

    The ``nixl`` meta package picks the wheel matching the process's CUDA version, and where
    it cannot read one (a CPU build of torch installed, no CUDA library loaded) it imports
    torch to ask: 1.3 s in a fresh process here, 5 s with six ranks starting at once
    (``benchmarks/bench_startup.py``). With one wheel installed there is nothing to pick.
    """
    if "torch" not in sys.modules:
        found = [m for m in WHEELS if importlib.util.find_spec(m) is not None]
        if len(found) == 1:
            return found[0]
    return "nixl" if importlib.util.find_spec("nixl") is not None else "nixl_cu12"


@cache
def load() -> tuple[ModuleType, ModuleType]:
    """NIXL's Python API module and its bindings (with the exception types)."""
    name = wheel()
    api = importlib.import_module(f"{name}._api")
    bindings = importlib.import_module(f"{name}._bindings")
    _logs_to_stderr()
    return api, bindings


def describe(exc: BaseException) -> str:
    """NIXL's own text for an error: its type names the status (``nixlNotFoundError: ...``)."""
    return f"{type(exc).__name__}: {exc}"


ERRORS: dict[str, tuple[type[XferError], str]] = {
    "nixlNotFoundError": (TransferError, "NIXL knows no such memory or agent (now)"),
    "nixlRemoteDisconnectError": (
        TransferError,
        "the peer agent is unreachable: closed, dead, or its UCX endpoint failed",
    ),
    "nixlBackendError": (TransferError, "the NIXL backend failed; NIXL's log on stderr says why"),
    "nixlInvalidParamError": (TransferError, "NIXL refused an argument"),
    "nixlCancelledError": (TransferError, "cancelled"),
    "nixlNotAllowedError": (ProtocolError, "NIXL does not allow it in this state"),
    "nixlMismatchError": (ProtocolError, "the two agents' NIXL configurations do not match"),
    "nixlNotSupportedError": (CapabilityError, "the configured NIXL backends do not support it"),
}
"""NIXL's exceptions (one type per status, no common base) as xferkit errors, with a hint."""


def error(what: str, exc: BaseException, subject: str | None = None) -> XferError:
    """``exc``, raised by NIXL during ``what``, as the xferkit error ``ERRORS`` names."""
    cls, hint = ERRORS.get(type(exc).__name__, (TransferError, ""))
    out = cls(f"{what} raised {describe(exc)}" + (f" ({hint})" if hint else ""), subject=subject)
    out.__cause__ = exc
    return out


_agent_lock = threading.Lock()


def new_agent(api: ModuleType, bindings: ModuleType, name: str, config: Any, delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the progress thread's poll delay set to ``delay_us``.

    ``nixl_agent.__init__`` builds the C++ agent config itself and pins its
    ``pthrDelay`` to 0 (a busy spin); the one way in is the bindings' agent
    constructor, wrapped for the duration of this call.
    """
    real = bindings.nixlAgent
    if not delay_us or getattr(api, "nixlBind", None) is not bindings:
        return api.nixl_agent(name, config)

    def make(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = delay_us
        return real(agent_name, agent_config)

    with _agent_lock:
        bindings.nixlAgent = make
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = real
