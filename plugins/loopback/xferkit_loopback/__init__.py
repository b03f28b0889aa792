"""The loopback driver: a strict, RDMA-like engine on CPU memory, in and across processes.

This module is the plugin entry point, so it stays light: the backend itself
is imported only when opened.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from xferkit.driver import BackendSpec, hookimpl

from .faults import Faults

__all__ = ["Faults", "register_backends"]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the loopback driver needs Linux (process_vm_writev, abstract unix sockets)"
    return None


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(name="loopback", target="xferkit_loopback.backend:LoopbackDriver", probe=_probe)
    )
