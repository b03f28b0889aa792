"""The Mooncake driver: xferkit's backend contract over the Mooncake Transfer Engine.

This module is the plugin entry point, so it stays light: it never imports
``mooncake``. The probe only asks whether the module is installed and whether
the system libraries its engine links against can be loaded.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable

from xferkit.driver import BackendSpec, hookimpl

__all__ = ["register_backends"]

# Shared libraries ``mooncake/engine.so`` needs from the system, and the Debian
# package providing each. libibverbs and librdmacm are the RDMA user-space
# libraries; libnuma and libcurl are linked by the engine too (readelf -d) and
# are absent from minimal images.
SYSTEM_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
RDMA_PACKAGES = "libibverbs1 librdmacm1"


def _probe() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install 'xferkit-mooncake[cpu]' or [cuda])"
    for library, package in SYSTEM_LIBRARIES.items():
        try:
            ctypes.CDLL(library)
        except OSError:
            packages = RDMA_PACKAGES if package in RDMA_PACKAGES.split() else package
            return f"{library} missing (apt-get install -y {packages})"
    return None


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(name="mooncake", target="xferkit_mooncake.backend:MooncakeDriver", probe=_probe)
    )
