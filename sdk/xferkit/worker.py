"""Asynchronous posts for engines whose batch call blocks: one thread runs them in order.

A driver whose engine call returns only when the batch is done posts a
``QueuedBatch`` to a ``BatchWorker``; the core sees a ``Posted`` that turns
DONE or FAILED when the thread has run it. Drivers import both from
``xferkit.driver``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .descriptors import Descriptors
from .posted import Posted, Status


class QueuedBatch(Posted):
    """One batch waiting for, or run by, a ``BatchWorker``. Subclass to carry driver state.

    ``descs`` is None for a notification sent alone.
    """

    __slots__ = ("_error", "_status", "cancelled", "descs", "finished", "notify")

    def __init__(self, descs: Descriptors | None, notify: bytes | None) -> None:
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


B = TypeVar("B", bound="QueuedBatch")


class BatchWorker(Generic[B]):
    """A daemon thread running ``execute(batch) -> error text or None`` for each posted batch."""

    def __init__(self, execute: Callable[[B], str | None], name: str) -> None:
        self._execute = execute
        self._queue: queue.SimpleQueue[B | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, batch: B) -> None:
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
