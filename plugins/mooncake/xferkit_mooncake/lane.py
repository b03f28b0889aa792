"""Posting: one worker thread per peer runs that peer's batches through the engine, in order.

Mooncake's only non-blocking completion check (``transfer_check_status``)
covers a single transfer, and ``get_batch_transfer_status`` spins until the
whole batch ends, so a batch is run by a worker with the synchronous batch
call (which releases the GIL) and the caller only ever reads a flag. One
worker per peer keeps at most one batch (<= 1024 entries) in flight towards
it, under the TCP transport's per-peer queue limit, and a slow or dead peer
never delays the others.
"""

from __future__ import annotations

import queue
import threading

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

from xferkit import Descriptors, Posted, Status

from .codes import explain, explain_transfer


def encode_message(message: bytes) -> str:
    """TransferNotify carries a str; latin-1 maps every byte to one code point and back."""
    return message.decode("latin-1")


def decode_message(text: str) -> bytes:
    """The inverse of ``encode_message``; text from other senders falls back to UTF-8."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


class Job(Posted):
    """One posted batch. The worker sets the outcome; ``poll`` only reads it."""

    __slots__ = ("_error", "anchor", "cancelled", "descs", "finished", "notify", "status")

    def __init__(self, descs: Descriptors, notify: bytes | None, anchor: tuple[int, int]) -> None:
        self.descs, self.notify, self.anchor = descs, notify, anchor
        self.status = Status.PENDING
        self._error = ""
        self.cancelled = False
        self.finished = threading.Event()

    def poll(self) -> Status:
        return self.status

    @property
    def error(self) -> str:
        return self._error

    def release(self) -> None:
        self.cancelled = True  # a batch still queued is dropped; one running finishes

    def block(self, timeout: float) -> None:
        self.finished.wait(timeout)

    def end(self, error: str | None = None) -> None:
        if error is None:
            self.status = Status.DONE
        else:
            self._error, self.status = error, Status.FAILED
        self.finished.set()


class Lane:
    """The worker for one peer segment."""

    def __init__(self, engine: TransferEngine, segment: str, sender: str) -> None:
        self.segment, self.sender = segment, sender
        self.users = 0  # connected Peer handles using this lane
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(engine,), name=f"xferkit-mooncake-{segment}", daemon=True
        )
        self._thread.start()

    def post(self, job: Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Finish the batches already queued, then end the thread."""
        self._queue.put(None)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self, engine: TransferEngine) -> None:
        # The thread holds its own reference: the engine outlives a batch in flight.
        while (job := self._queue.get()) is not None:
            if job.cancelled:
                job.end("aborted before it was posted")
                continue
            try:
                job.end(self._execute(engine, job))
            except Exception as exc:  # never let the worker die silently
                job.end(f"mooncake worker error: {type(exc).__name__}: {exc}")

    def _execute(self, engine: TransferEngine, job: Job) -> str | None:
        d = job.descs
        src, dst, nbytes = d.src.tolist(), d.dst.tolist(), d.nbytes.tolist()
        if job.notify is None:
            if not src:
                return None
            call = "batch_transfer_sync_write"
            rc = engine.batch_transfer_sync_write(self.segment, src, dst, nbytes)
        else:
            if not src:
                # The engine refuses an empty batch (-1) and reads entries[0] for the
                # notification's target: a zero-length entry moves nothing but carries it.
                src, dst, nbytes = [job.anchor[0]], [job.anchor[1]], [0]
            call = "batch_transfer_sync with TransferNotify"
            note = TransferNotify(self.sender, encode_message(job.notify))
            rc = engine.batch_transfer_sync(
                self.segment, src, dst, nbytes, TransferOpcode.Write, note
            )
        if rc == 0:
            return None
        text = (
            f"Mooncake {call} of {len(d)} descriptor(s), {d.total_bytes} bytes, to segment "
            f"{self.segment} returned {explain_transfer(rc)}; "
        )
        probe = engine.send_probe(self.segment)
        if probe == 0:
            return text + (
                "the peer answers send_probe, so it refused the write (a destination outside "
                "the memory it registers now) or the transfer timed out; the engine's log on "
                "stderr has the details"
            )
        return text + f"send_probe to it returned {explain(probe)}: the peer is gone or unreachable"
