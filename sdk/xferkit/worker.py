"""Asynchronous posts for drivers whose engine calls block: a thread runs batches in order.

Many engines only offer a synchronous batch call (that releases the GIL). A
driver hands each batch to a ``BatchWorker`` and returns the ``QueuedBatch``
as its ``Posted``: ``poll`` then only reads a field the worker set, and
``Transfer.wait`` sleeps on the batch's completion event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .backend import Posted, Status
from .planner import Descriptors


class QueuedBatch(Posted):
    """One batch waiting for, or run by, a ``BatchWorker``. Subclass to carry driver state."""

    __slots__ = ("_error", "_status", "cancelled", "descs", "finished", "notify")

    def __init__(self, descs: Descriptors, notify: bytes | None) -> None:
        self.descs, self.notify = descs, notify
        self._status = Status.PENDING
        self._error = ""
        self.cancelled = False
        self.finished = threading.Event()

    def poll(self) -> Status:
        return self._status

    @property
    def error(self) -> str:
        return self._error

    def block(self, timeout: float) -> None:
        self.finished.wait(timeout)

    def release(self) -> None:
        """A batch still queued is dropped; one already running finishes."""
        self.cancelled = True

    def end(self, error: str | None = None) -> None:
        """Record the outcome (None: done) and wake whoever waits."""
        if error is None:
            self._status = Status.DONE
        else:
            self._error, self._status = error, Status.FAILED
        self.finished.set()


class BatchWorker:
    """A daemon thread running ``execute(batch) -> error text or None`` for each posted batch."""

    def __init__(self, execute: Callable[[QueuedBatch], str | None], name: str) -> None:
        self._execute = execute
        self._queue: queue.SimpleQueue[QueuedBatch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, batch: QueuedBatch) -> None:
        self._queue.put(batch)

    def stop(self) -> None:
        """Run what is queued, then end the thread."""
        self._queue.put(None)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end; False if it is still running after ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if batch.cancelled:
                batch.end("aborted before it ran")
                continue
            try:
                batch.end(self._execute(batch))
            except Exception as exc:  # never let the worker die silently
                batch.end(f"driver worker error: {type(exc).__name__}: {exc}")
