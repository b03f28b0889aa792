"""What the Mooncake tests share: how they open a backend, reach its driver, watch the engine."""

from __future__ import annotations

from typing import Any

import xferkit as xk
from xferkit_mooncake.backend import MooncakeDriver

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}
WAIT_S = 10.0


def open_mooncake(**extra: Any) -> xk.Backend:
    return xk.open_backend("mooncake", **{**OPTIONS, **extra})


def driver_of(backend: xk.Backend) -> MooncakeDriver:
    driver = backend.driver
    assert isinstance(driver, MooncakeDriver)
    return driver


class EngineSpy:
    """The real engine (not a mock), recording the sizes of the ranges registered through it."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.sizes: list[int] = []

    def batch_register_memory(self, addrs: list[int], sizes: list[int], *args: Any) -> int:
        self.sizes += sizes
        return int(self._engine.batch_register_memory(addrs, sizes, *args))

    def register_memory(self, addr: int, size: int, *args: Any) -> int:
        self.sizes.append(size)
        return int(self._engine.register_memory(addr, size, *args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
