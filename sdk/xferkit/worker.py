"""Asynchronous posts for engines whose batch call blocks: one thread runs them in order.

A driver whose engine call returns only when the batch is done posts a
``QueuedBatch`` to a ``BatchWorker``; the core sees a ``Posted`` that turns
DONE or FAILED when the thread has run it. Drivers import both from
``xferkit.driver``::

    worker = BatchWorker(execute, name="mydriver-peer-1")   # one per peer, in connect

    def execute(batch: QueuedBatch) -> str | None:           # on the worker thread
        # batch.descs: the Descriptors to move (None: a notification alone);
        # batch.notify: the message to deliver after the data (None: none).
        ...                                                  # the engine's blocking call
        return None                                          # or your engine's error text

    def post(self, link, descs, notify):                     # Driver.post
        batch = QueuedBatch(descs, notify)
        link.worker.post(batch)
        return batch                                         # the Posted the core polls

Release: the core calls ``release()`` to abort. A batch still queued is then
dropped without running (FAILED, "aborted before it ran"). One already in
``execute`` is not interrupted: ``execute`` notices by reading
``batch.cancelled`` (a plain attribute, set from another thread) between the
steps it can stop at, and returns when it has made sure no byte of the batch
can land any more; until it returns, ``poll`` says PENDING, as the contract
requires. An engine call that cannot be interrupted simply runs to its end.
In ``disconnect``/``close``, ``stop()`` the worker and ``join`` it (every
transfer on it has ended by then).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .descriptors import Descriptors
from .errors import ArgumentError
from .posted import Posted, Status
from .threadname import name_thread

log = logging.getLogger("xferkit.worker")


class QueuedBatch(Posted):
    """One batch waiting for, or run by, a ``BatchWorker``. Subclass to carry driver state.

    ``descs``: the checked ``Descriptors`` to move, or None for a notification sent alone.
    ``notify``: the message to deliver after the data, or None. ``cancelled``: set when the
    core released the batch; ``execute`` reads it to stop a running batch early.
    """

    __slots__ = ("_ended", "_error", "_status", "_wake", "cancelled", "descs", "notify")

    def __init__(self, descs: Descriptors | None, notify: bytes | None) -> None:
        self.descs, self.notify = descs, notify
        self._status = Status.PENDING
        self._error = ""
        self.cancelled = False
        # Held until ``end``: a lock costs a twentieth of an Event (a Condition built in Python),
        # and one is made for every small write on the control thread's path.
        self._ended = threading.Lock()
        self._ended.acquire()
        self._wake: Callable[[], None] | None = None

    def poll(self) -> Status:
        return self._status

    @property
    def error(self) -> str:
        return self._error

    def block(self, timeout: float) -> None:
        if self._ended.acquire(timeout=max(timeout, 0.0)):
            self._ended.release()  # the next waiter passes too

    def on_end(self, wake: Callable[[], None]) -> bool:
        self._wake = wake
        if self._status is not Status.PENDING:  # ended before the hook was set: said now
            wake()
        return True

    def release(self) -> None:
        """Abort: a batch still queued is dropped; one running sees ``cancelled`` and may stop."""
        self.cancelled = True

    def end(self, error: str | None = None) -> None:
        """Record the outcome (None: done) and wake whoever waits; the first outcome stays."""
        if self._status is not Status.PENDING:
            return
        if error is None:
            self._status = Status.DONE
        else:
            self._error, self._status = error, Status.FAILED
        self._ended.release()
        wake = self._wake  # read after the status: a hook set meanwhile calls itself
        if wake is not None:
            wake()


B = TypeVar("B", bound="QueuedBatch")


class BatchWorker(Generic[B]):
    """A daemon thread running ``execute(batch) -> error text or None`` for each posted batch,
    in the order posted; an exception ``execute`` raises fails that batch, with its text.

    ``together(run)``, when given, moves several batches in one engine call: batches queued
    behind the one taken (not cancelled; at most ``max_run`` of them with ``max_entries``
    descriptors in all) go to it as one run, in order, and each ends with its outcome. An
    engine whose every call costs a fixed round trip then pays it once per run, not once per
    batch, exactly when batches queue up: under load.

    ``nice``, when above 0, raises the thread's nice value by that much as it starts (Linux
    sets it per thread), for an engine call that busy-waits for its batch: the spinning
    thread then yields a busy CPU to the threads doing the work, and still has an idle one.
    """

    def __init__(
        self,
        execute: Callable[[B], str | None],
        name: str,
        *,
        together: Callable[[list[B]], str | None] | None = None,
        max_run: int = 32,
        max_entries: int = 1024,
        nice: int = 0,
    ) -> None:
        for what, value in (("execute", execute), ("together", together)):
            if not callable(value) and not (what == "together" and value is None):
                raise ArgumentError(f"BatchWorker's {what} must be callable, not {value!r:.80}")
        for what, bound in (("max_run", max_run), ("max_entries", max_entries)):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ArgumentError(f"BatchWorker's {what} must be an int >= 1, not {bound!r:.80}")
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ArgumentError(f"BatchWorker's nice must be an int in 0..19, not {nice!r:.80}")
        self._execute, self._together, self._nice = execute, together, nice
        self._max_run, self._max_entries = max_run, max_entries
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
        name_thread(threading.current_thread().name)
        if self._nice:
            _lower_priority(self._nice)
        held: list[B | None] = []  # taken from the queue but not fitting the last run
        while (batch := held.pop() if held else self._queue.get()) is not None:
            if batch.cancelled:
                batch.end("aborted before it ran")
                continue
            run = [batch]
            if self._together is not None:
                held = self._gather(run)
            self._finish(run)

    def _gather(self, run: list[B]) -> list[B | None]:
        """Add the batches queued now that fit ``run``; what was taken but does not fit."""
        entries = _entries(run[0])
        while len(run) < self._max_run:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return []
            if batch is None or entries + _entries(batch) > self._max_entries:
                return [batch]
            if batch.cancelled:
                batch.end("aborted before it ran")
                continue
            run.append(batch)
            entries += _entries(batch)
        return []

    def _finish(self, run: list[B]) -> None:
        try:
            if len(run) == 1:
                error = self._execute(run[0])
            else:
                assert self._together is not None
                error = self._together(run)
                if error is not None:
                    error += f" (moved in one engine call with {len(run) - 1} other batch(es))"
        except Exception as exc:  # never let the worker die silently
            error = f"driver worker error: {type(exc).__name__}: {exc}"
        for batch in run:
            batch.end(error)


def _lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (at most to 19); where the platform
    cannot, the thread runs as it is (logged)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + by, 19))
    except (AttributeError, OSError) as exc:
        log.debug("cannot lower the priority of %s: %s", threading.current_thread().name, exc)


def _entries(batch: QueuedBatch) -> int:
    return 1 if batch.descs is None else len(batch.descs)
