"""One asynchronous write as the engine sees it: split into driver batches, notified last.

Large descriptor sets go out in several driver batches. With a notification,
it rides on the last batch, posted only once every other batch is done, so the
peer never sees it before the data; that last batch is posted by ``poll`` (or
``wait``): a split write progresses while its sender polls it, as an engine
does anyway to learn when the source memory is free again. Without one,
nothing is ordered and every batch goes out at once.

A transfer moves through explicit phases (h11's way: one state, named):
``SENDING`` (batches out or held back), ``FAILING`` (an error is set and the
driver still holds a batch), then ``DONE`` or ``FAILED``. ``Status`` is
derived from the phase: both live phases read ``PENDING``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .arguments import expect, seconds
from .descriptors import Descriptors
from .driver import Posted, Status
from .errors import TransferError, XferError

if TYPE_CHECKING:
    from .backend import Peer

log = logging.getLogger("xferkit")

Post = Callable[[Descriptors | None, bytes | None], Posted]
"""Posts one batch (None: the notification alone) to the transfer's peer."""


class Phase(enum.Enum):
    SENDING = "sending"
    """Batches are out (or the notified last one is held back); none failed."""
    FAILING = "failing"
    """``error`` is set, nothing more is posted; the driver still holds a batch."""
    DONE = "done"
    FAILED = "failed"


STATUS = {
    Phase.SENDING: Status.PENDING,
    Phase.FAILING: Status.PENDING,
    Phase.DONE: Status.DONE,
    Phase.FAILED: Status.FAILED,
}
"""What each phase reads as to an engine."""


class Transfer:
    """An asynchronous write: ``poll`` never blocks, ``wait`` does, ``error`` says why it failed.

    Safe to poll from several threads. A terminal state is final and means what
    it says: DONE, every byte landed; FAILED, no byte of it will land any more
    and its source is no longer read (a failing write stays PENDING until the
    driver reports every batch of it ended). A deadline (``timeout`` given to
    ``Backend.write``) fails it when passed.
    """

    def __init__(
        self,
        peer: Peer,
        descs: Descriptors,
        batches: list[Descriptors],
        notify: bytes | None,
        post: Post,
        on_end: Callable[[Transfer], None],
        timeout: float | None = None,
    ) -> None:
        self.peer = peer
        self.descs = descs
        self.error: TransferError | None = None
        self._post = post
        self._on_end = on_end
        self._waiting: list[Descriptors | None] = list(batches)
        if notify is not None and not batches:
            self._waiting.append(None)  # the notification alone
        self._notify = notify
        self._posted: list[Posted] = []
        self.post_s = 0.0  # time spent inside the driver's post calls, summed (telemetry)
        self._running: list[Posted] = []  # posted, not yet seen DONE
        self._released = 0  # posted[:released] were released
        self._phase = Phase.SENDING
        self._status = Status.PENDING  # STATUS[_phase], kept beside it (an enum hashes slowly)
        self.posted_at = time.monotonic()
        self._deadline = None if timeout is None else self.posted_at + timeout
        self._timeout = timeout
        self._lock = threading.RLock()
        self._keepalive: object = None  # memory a closed backend could not release yet
        self._wake: Callable[[], None] | None = None  # told when a batch ends (``wake_on_end``)
        self.wakes = False  # every batch posted so far calls ``_wake`` when it ends
        with self._lock:
            self._advance()

    @property
    def count(self) -> int:
        """How many descriptors the write moves (``descs`` holds them)."""
        return len(self.descs)

    @property
    def nbytes(self) -> int:
        return self.descs.total_bytes

    @property
    def phase(self) -> Phase:
        """Where the write is: ``Status`` is derived from it (``poll`` advances it)."""
        return self._phase

    def wake_on_end(self, wake: Callable[[], None]) -> bool:
        """Have ``wake`` called (from a driver's thread) whenever a batch of this write ends,
        so that a poll then moves it on; False, and ``wakes`` stays False, when a driver's
        batch cannot say so (it must be polled). Terminal already: called at once."""
        with self._lock:
            self._wake = wake
            if self._status is not Status.PENDING:
                wake()
                self.wakes = True
                return True
            live = self._running if self._phase is Phase.SENDING else self._posted
            self.wakes = all(p.on_end(wake) for p in live)
            return self.wakes

    def poll(self) -> Status:
        if self._status is Status.PENDING:
            with self._lock:
                self._advance()
        return self._status

    def wait(self, timeout: float | None = None) -> None:
        """Block until terminal; raise the root-cause ``TransferError`` if it failed.

        Past ``timeout`` it raises without ending the write (``abort`` does that).
        """
        deadline = None if timeout is None else time.monotonic() + seconds(timeout, "timeout")
        while self.poll() is Status.PENDING:
            left = 0.01 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TransferError(
                    f"write to peer {self.peer.name} still pending after {timeout} s",
                    subject=self.peer.name,
                )
            self._block(min(left, 0.01))
        if self.error is not None:
            raise self.error

    def abort(
        self, why: str = "aborted by the caller", timeout: float = 10.0, *, wait: bool = True
    ) -> None:
        """End a pending write as FAILED; return once no byte of it can land any more.

        Nothing more is posted and every posted batch is released (cancelled);
        then this waits, at most ``timeout`` seconds, for the driver to report
        each one ended. Raises ``TransferError`` if the driver has not by then
        (the write stays PENDING until it has). With ``wait=False`` it returns at
        once: ``poll()`` turns FAILED when the driver has let go (an event loop
        that must not block polls it).
        """
        limit = time.monotonic() + seconds(timeout, "timeout")
        expect(wait, bool, "Transfer.abort(wait=)")
        with self._lock:
            if self._phase is Phase.SENDING:
                self._fail(why)
        if not wait:
            self.poll()
            return
        while self.poll() is Status.PENDING:
            left = limit - time.monotonic()
            if left <= 0:
                raise TransferError(
                    f"write to peer {self.peer.name}: aborted, but a batch was still running "
                    f"in the driver {timeout} s later",
                    subject=self.peer.name,
                )
            self._block(min(left, 0.01))

    # -- progress --------------------------------------------------------------

    def _block(self, timeout: float) -> None:
        pending = next((p for p in list(self._posted) if p.poll() is Status.PENDING), None)
        if pending is not None:
            pending.block(timeout)

    def _post_next(self, batch: Descriptors | None, notify: bytes | None) -> None:
        began = time.monotonic()
        try:
            posted = self._post(batch, notify)
        except Exception as exc:  # the driver refused the post itself
            what = "the notification" if batch is None else f"{len(batch)} descriptors"
            refusal = f"posting {what} failed: {exc}"
            earlier = next((p for p in self._posted if p.poll() is Status.FAILED), None)
            if earlier is None:
                self._fail(refusal, exc)
            else:  # an earlier batch failed first: the refusal is its consequence
                self._fail(earlier.error, later=TransferError(refusal, subject=self.peer.name))
            return
        finally:
            self.post_s += time.monotonic() - began
        self._posted.append(posted)
        self._running.append(posted)
        if self._wake is not None and not posted.on_end(self._wake):
            self.wakes = False

    def _advance(self) -> None:
        if self._phase is Phase.SENDING:
            self._send()
        if self._phase is Phase.FAILING and all(
            p.poll() is not Status.PENDING for p in self._posted
        ):
            self._end(Phase.FAILED)

    def _send(self) -> None:
        """Post what may go, collect what ended; DONE once every batch is (SENDING only)."""
        # Held back: the last batch when a notification rides on it; else nothing.
        held = 1 if self._notify is not None else 0
        while len(self._waiting) > held:
            self._post_next(self._waiting.pop(0), None)
            if self._phase is not Phase.SENDING:
                return
        while True:
            running: list[Posted] = []  # a plain loop: a write is polled a few times a request
            for p in self._running:
                st = p.poll()
                if st is Status.FAILED:  # the first to fail (in posting order) is the cause
                    self._fail(p.error, getattr(p, "cause", None))
                    return
                if st is Status.PENDING:
                    running.append(p)
            self._running = running
            if running:
                break
            if not self._waiting:  # every batch posted and done
                self._release_all()
                self._end(Phase.DONE)
                return
            # Every other batch is done: the notified last one may go (and may be done at once).
            self._post_next(self._waiting.pop(), self._notify)
            if self._phase is not Phase.SENDING:
                return
        self._check_deadline()

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            self._fail(f"timed out: not done {self._timeout} s after it was posted")

    def _fail(
        self, text: str, cause: BaseException | None = None, later: XferError | None = None
    ) -> None:
        self.error = TransferError(
            f"write to peer {self.peer.name} failed: {text}", subject=self.peer.name
        )
        if cause is not None:
            self.error.__cause__ = cause
        # Abort the rest; failures they report later are consequences, attached only.
        for p in self._posted:
            if p.poll() is Status.FAILED and p.error != text:
                self.error.attach(TransferError(p.error, subject=self.peer.name))
        if later is not None:
            self.error.attach(later)
        self._waiting.clear()
        self._phase = Phase.FAILING
        self._release_all()

    def _release_all(self) -> None:
        for p in self._posted[self._released :]:
            try:
                p.release()
            except Exception as exc:
                if self.error is not None:
                    self.error.attach(exc)
                else:  # the data arrived; a driver handle may have leaked
                    log.warning("%s: releasing a completed batch failed: %s", self.peer.name, exc)
        self._released = len(self._posted)

    def _end(self, phase: Phase) -> None:
        self._phase, self._status = phase, STATUS[phase]
        self._on_end(self)


__all__ = [
    "STATUS",
    "Phase",
    "Post",
    "Transfer",
    "seconds",
]  # seconds: re-exported for older imports
