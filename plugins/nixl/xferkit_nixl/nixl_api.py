"""Importing NIXL: the module that holds it, its logger sent to stderr, its errors as text."""

from __future__ import annotations

import logging
import sys
from functools import cache
from types import ModuleType


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


@cache
def load() -> tuple[ModuleType, ModuleType]:
    """NIXL's Python API module and its bindings (with the exception types)."""
    try:  # the nixl meta package picks the wheel matching the CUDA version
        from nixl import _api as api
        from nixl import _bindings as bindings
    except ImportError:
        from nixl_cu12 import _api as api  # type: ignore[no-redef]
        from nixl_cu12 import _bindings as bindings  # type: ignore[no-redef]
    _logs_to_stderr()
    return api, bindings


def describe(exc: BaseException) -> str:
    """NIXL's own text for an error: its type names the status (``nixlNotFoundError: ...``)."""
    return f"{type(exc).__name__}: {exc}"
