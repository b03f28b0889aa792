"""The pack worker: staged rounds are gathered into staging off the control thread.

One thread, started on the first staged chunk, so round k+1 packs while the
control thread posts round k and answers heartbeats. Each copy reports when it
began and ended (``handle.timeline``'s ``pack``) as its future's result, and its
end wakes the control thread (``("pump", rid)``) to post the packed round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..copier import Copier
from ..descriptors import Descriptors


class Packer:
    def __init__(self, copier: Copier, report: Callable[[tuple[Any, ...]], None]) -> None:
        self._copier, self._report = copier, report
        self._pool: ThreadPoolExecutor | None = None

    def run(self, rid: str, descs: Descriptors) -> Future[tuple[float, float]]:
        """Start a pack copy of ``rid``'s; ``Settings.runner``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="xferkit-pack")
        future = self._pool.submit(self._copy, descs)
        future.add_done_callback(lambda _: self._report(("pump", rid)))
        return future

    def _copy(self, descs: Descriptors) -> tuple[float, float]:
        began = time.monotonic()
        self._copier.copy(descs.src, descs.dst, descs.nbytes)
        return began, time.monotonic()

    def stop(self) -> None:
        """Wait for the copy in flight (it reads the source, writes staging), end the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
