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

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

from xferkit import BatchWorker, Descriptors, QueuedBatch

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


class Job(QueuedBatch):
    """One posted batch, with a registered (local, remote) address pair for notify-only posts."""

    __slots__ = ("anchor",)

    def __init__(self, descs: Descriptors, notify: bytes | None, anchor: tuple[int, int]) -> None:
        super().__init__(descs, notify)
        self.anchor = anchor


class Lane:
    """The worker for one peer segment."""

    def __init__(self, engine: TransferEngine, segment: str, sender: str) -> None:
        self.segment, self.sender = segment, sender
        self.users = 0  # connected Peer handles using this lane
        # The worker's closure holds the engine: it outlives a batch in flight.
        self._worker = BatchWorker(
            lambda job: self._execute(engine, job), name=f"xferkit-mooncake-{segment}"
        )

    def post(self, job: Job) -> None:
        self._worker.post(job)

    def stop(self) -> None:
        """Finish the batches already queued, then end the thread."""
        self._worker.stop()

    def join(self, timeout: float) -> bool:
        return self._worker.join(timeout)

    @property
    def running(self) -> bool:
        return self._worker.alive

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
