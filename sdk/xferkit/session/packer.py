"""The pack worker: staged rounds are gathered into staging off the control thread.

One thread, started on the first staged chunk, so round k+1 packs while the
control thread posts round k and answers heartbeats. Each copy reports when it
began and ended (``handle.timeline``'s ``pack``) as its ``Pack``'s result, and
its end wakes the control thread (``("pump", rid)``) to post the packed round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..copier import Copier
from ..descriptors import Descriptors
from ..threadname import name_thread

log = logging.getLogger("xferkit.session")


class Pack:
    """One pack copy handed to the worker, waited on as a future (``rounds.Pending``).

    Its end is a lock held until the copy ends rather than a
    ``concurrent.futures.Future``, whose Condition and RLock, built in Python for every
    staged round, were 5% of a prefill rank's CPU under load.
    """

    __slots__ = ("_ended", "_error", "_span", "descs", "ended", "rid")

    def __init__(self, rid: str, descs: Descriptors) -> None:
        self.rid, self.descs = rid, descs
        self.ended = False  # set by the worker before it lets go of ``_ended``
        self._span = (0.0, 0.0)
        self._error: BaseException | None = None
        self._ended = threading.Lock()
        self._ended.acquire()

    def done(self) -> bool:
        return self.ended

    def result(self) -> tuple[float, float]:
        """When the copy began and ended, once it has (waiting for it); what it raised."""
        with self._ended:  # held by the worker until the copy ends
            pass
        if self._error is not None:
            raise self._error
        return self._span


class Packer:
    def __init__(self, copier: Copier, report: Callable[[tuple[Any, ...]], None]) -> None:
        self._copier, self._report = copier, report
        self._queue: queue.SimpleQueue[Pack | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def run(self, rid: str, descs: Descriptors) -> Pack:
        """Start a pack copy of ``rid``'s; ``Settings.runner``. A RuntimeError once stopped
        (the request fails: nothing of the round was sent)."""
        if self._stopped:
            raise RuntimeError("the Session's pack worker has stopped")
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="xferkit-pack", daemon=True)
            self._thread.start()
        pack = Pack(rid, descs)
        self._queue.put(pack)
        return pack

    def _work(self) -> None:
        name_thread("xk-pack")
        while (pack := self._queue.get()) is not None:
            began = time.monotonic()
            try:
                self._copier.copy(pack.descs.src, pack.descs.dst, pack.descs.nbytes)
            except BaseException as exc:  # the core fails the request with it (``ready``); the
                pack._error = exc  # worker goes on, so no later pack waits on a dead thread
            pack._span = (began, time.monotonic())
            pack.ended = True
            pack._ended.release()
            try:
                self._report(("pump", pack.rid))
            except Exception:  # a Session closing under it: nothing left to wake
                log.exception("the pack worker could not wake the control thread")

    def stop(self) -> None:
        """Run the packs queued (each reads its source, writes staging), end the thread."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
