"""The NIXL driver: NVIDIA NIXL agents (UCX by default) behind xferkit's driver contract.

This module is the plugin entry point, so it stays light: the probe finds NIXL
with ``importlib.util.find_spec`` without importing it, and the backend is
imported only when opened.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

from xferkit.driver import BackendSpec, hookimpl

__all__ = ["INSTALL", "register_backends"]

INSTALL = "pip install --no-deps nixl-cu12 nixl"
"""How NIXL is installed: without its declared torch dependency (host memory never needs it)."""

_BINARIES = ("nixl_cu12", "nixl_cu13")  # the wheels that hold NIXL's compiled code


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "NIXL is built for Linux only"
    if any(importlib.util.find_spec(name) is not None for name in _BINARIES):
        return None
    if importlib.util.find_spec("nixl") is not None:
        return (
            "the nixl meta package is installed but not its compiled wheel nixl-cu12 "
            f"({INSTALL}; it declares torch, which must not be pulled on CPU machines)"
        )
    return (
        f"nixl is not installed ({INSTALL}; it declares torch, which must not be pulled "
        "on CPU machines)"
    )


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(name="nixl", target="xferkit_nixl.backend:NixlDriver", probe=_probe))
