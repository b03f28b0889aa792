"""Names for xferkit's threads at the OS, so that ``top -H``, ``ps -L``, ``perf`` and py-spy
show which of them spends an engine's CPU: Python before 3.14 names a thread only for
itself, and the OS sees every thread of the process as ``python``."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable
from typing import Any

from .arguments import expect

_PR_SET_NAME = 15
_LIMIT = 15
"""Bytes of a name the OS keeps (Linux: 16 with the terminating zero)."""

_prctl: Callable[..., Any] | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):  # no C library: names stay the process's
        _prctl = ctypes.CDLL(None, use_errno=True).prctl


def name_thread(name: str) -> None:
    """Name the calling thread at the OS: ``name``'s first 15 bytes, a leading ``xferkit-``
    shortened to ``xk-``. Where the platform cannot, nothing happens: a name is for people
    reading a process, never for correctness. A name that is not a ``str`` is an
    ``ArgumentError``."""
    expect(name, str, "name_thread() (the thread's name)")
    if _prctl is not None:
        short = "xk-" + name[8:] if name.startswith("xferkit-") else name
        raw = short.encode("utf-8", "replace")[:_LIMIT]  # a lone surrogate cannot encode
        _prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
