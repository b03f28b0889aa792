"""One asynchronous write as the engine sees it: split into driver batches, notified last.

Large descriptor sets go out in several driver batches; the notification
rides on the last batch, posted only once every other batch is done, so the
peer never sees it before the data. That last batch is posted by ``poll`` (or
``wait``): a split write progresses while its sender polls it, as an engine
does anyway to learn when the source memory is free again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .descriptors import Descriptors
from .driver import Posted, Status
from .errors import TransferError, XferError

if TYPE_CHECKING:
    from .backend import Peer

log = logging.getLogger("xferkit")

Post = Callable[[Descriptors | None, bytes | None], Posted]
"""Posts one batch (None: the notification alone) to the transfer's peer."""


class Transfer:
    """An asynchronous write: ``poll`` never blocks, ``wait`` does, ``error`` says why it failed.

    Safe to poll from several threads. A terminal state (DONE, FAILED) is final.
    """

    def __init__(
        self,
        peer: Peer,
        descs: Descriptors,
        batches: list[Descriptors],
        notify: bytes | None,
        post: Post,
        on_end: Callable[[Transfer], None],
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
        self._status = Status.PENDING
        self._lock = threading.RLock()
        with self._lock:
            self._advance()

    @property
    def descriptors(self) -> int:
        return len(self.descs)

    @property
    def nbytes(self) -> int:
        return self.descs.total_bytes

    def poll(self) -> Status:
        if self._status is Status.PENDING:
            with self._lock:
                self._advance()
        return self._status

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the root-cause ``TransferError`` if it failed."""
        deadline = None if timeout is None else time.monotonic() + seconds(timeout, "timeout")
        while self.poll() is Status.PENDING:
            left = 0.01 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TransferError(
                    f"write to peer {self.peer.name} still pending after {timeout} s",
                    subject=self.peer.name,
                )
            pending = next((p for p in list(self._posted) if p.poll() is Status.PENDING), None)
            if pending is not None:
                pending.block(min(left, 0.01))
        if self.error is not None:
            raise self.error

    def abort(self, why: str = "aborted by the caller") -> None:
        """End a pending write as FAILED: nothing more is posted, posted batches are released."""
        with self._lock:
            if self._status is Status.PENDING:
                self._fail(why)

    # -- progress --------------------------------------------------------------

    def _post_next(self, batch: Descriptors | None, notify: bytes | None) -> None:
        try:
            self._posted.append(self._post(batch, notify))
        except Exception as exc:  # the driver refused the post itself
            what = "the notification" if batch is None else f"{len(batch)} descriptors"
            refusal = f"posting {what} failed: {exc}"
            earlier = next((p for p in self._posted if p.poll() is Status.FAILED), None)
            if earlier is None:
                self._fail(refusal, exc)
            else:  # an earlier batch failed first: the refusal is its consequence
                self._fail(earlier.error, later=TransferError(refusal, subject=self.peer.name))

    def _advance(self) -> None:
        if self._status is not Status.PENDING:
            return
        # All but the last batch go out at once; the last (with the notification) waits.
        while len(self._waiting) > 1:
            self._post_next(self._waiting.pop(0), None)
            if self._status is Status.FAILED:
                return
        states = [p.poll() for p in self._posted]
        for p, st in zip(self._posted, states, strict=True):
            if st is Status.FAILED:
                self._fail(p.error)
                return
        if all(st is Status.DONE for st in states):
            if self._waiting:
                self._post_next(self._waiting.pop(), self._notify)
                if self._status is Status.PENDING:
                    self._advance()
                return
            self._finish(Status.DONE)

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
        self._finish(Status.FAILED)

    def _finish(self, status: Status) -> None:
        self._status = status
        for p in self._posted:
            try:
                p.release()
            except Exception as exc:
                if self.error is not None:
                    self.error.attach(exc)
                else:  # the data arrived; a driver handle may have leaked
                    log.warning("%s: releasing a completed batch failed: %s", self.peer.name, exc)
        self._on_end(self)

    def _drained(self) -> bool:
        """True once no released batch of this transfer can still be running in the driver."""
        return all(p.poll() is not Status.PENDING for p in self._posted)


def seconds(value: object, what: str) -> float:
    """A caller's duration, checked: a bool, a string or a negative number is an error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise XferError(f"{what} must be a number of seconds >= 0, not {value!r}")
    return float(value)
