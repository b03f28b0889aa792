"""Posting: one worker thread per peer runs that peer's batches through the engine, in order.

Mooncake's only non-blocking completion check (``transfer_check_status``)
covers a single transfer, and ``get_batch_transfer_status`` spins until the
whole batch ends, so a batch is run by a worker with the synchronous batch
call (which releases the GIL) and the caller only ever reads a flag. One
worker per peer keeps at most one call (<= 1024 entries) in flight towards
it, under the TCP transport's per-peer queue limit, and a slow or dead peer
never delays the others. The batches queued behind the one taken go in the
same call, their messages framed in one notification: a call costs a round
trip whatever it carries, and under load they queue.

The synchronous call spins on its core until the batch ends, a lane per peer with a batch in
flight: so a lane runs at a lower priority (``MooncakeOptions.lane_nice``), and yields a busy
CPU to the engine's transport threads and the Session's, which do the work it waits for.

A batch inside the engine cannot be cancelled: the binding offers no abort, and
freeing a batch in flight leaves its slices moving bytes. So a released batch
stays PENDING until the engine returns, which the transport's stall timeout
bounds (``stall_timeout``); only then may the core call the write FAILED.
"""

from __future__ import annotations

import threading

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

from xferkit.driver import BatchWorker, Descriptors, QueuedBatch

from .codes import explain, explain_transfer

PROBE_S = 1.0
"""How long a failed batch waits for ``send_probe`` to tell a refusal from a silent peer."""


RUN = b"\x00xferkit-run\x00"
"""Opens a notification carrying the messages of several batches run in one call (each after
a 4-byte little-endian length); a lone message that happens to start so is framed too."""


def encode_messages(messages: list[bytes]) -> str:
    """TransferNotify carries a str; latin-1 maps every byte to one code point and back."""
    if len(messages) == 1 and not messages[0].startswith(RUN):
        return messages[0].decode("latin-1")
    return (RUN + b"".join(len(m).to_bytes(4, "little") + m for m in messages)).decode("latin-1")


def decode_messages(text: str) -> list[bytes]:
    """The inverse of ``encode_messages``; text from other senders falls back to UTF-8 and
    comes whole, as does a frame whose lengths do not add up or that holds more messages
    than a run carries (a hostile peer's 1 MB of empty messages would cost the receiver's
    control thread a quarter of a million of them)."""
    try:
        data = text.encode("latin-1")
    except UnicodeEncodeError:
        return [text.encode("utf-8")]
    if not data.startswith(RUN):
        return [data]
    messages: list[bytes] = []
    at = len(RUN)
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + size > len(data) or len(messages) == MAX_RUN:
            return [data]
        messages.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return messages


class Local:
    """The driver's current engine and segment, read by every lane for each batch.

    A registration after an endpoint was handed out gets a new engine (a new
    segment, see ``MooncakeDriver.register_regions``); lanes opened before it
    send through the new one from their next batch on. ``engine`` is None once
    the driver closed.
    """

    __slots__ = ("engine", "segment")

    def __init__(self, engine: TransferEngine | None, segment: str) -> None:
        self.engine, self.segment = engine, segment


class Lane(BatchWorker[QueuedBatch]):
    """The worker for one connection to a peer segment.

    A running batch holds its engine in a local variable: the engine outlives it.
    """

    def __init__(self, local: Local, segment: str, nice: int) -> None:
        self.segment = segment
        super().__init__(
            lambda job: _execute(local, segment, [job]),
            name=f"xferkit-mooncake-{segment}",
            together=lambda run: _execute(local, segment, run),
            max_run=MAX_RUN,
            max_entries=MAX_ENTRIES,
            nice=nice,
        )


MAX_ENTRIES = 1024
"""Most entries one call carries: under the TCP transport's queue limit per peer."""
MAX_RUN = 32
"""Most batches, hence messages, one call carries."""


def _execute(local: Local, segment: str, run: list[QueuedBatch]) -> str | None:
    """One engine call for the batches of ``run``; the notification (their messages, in
    order) goes after all their data."""
    descs = [job.descs for job in run if job.descs is not None]
    assert descs  # the driver sends a notification alone as a zero-length entry
    d = descs[0] if len(descs) == 1 else _moving(Descriptors.concat(descs))
    engine, sender = local.engine, local.segment
    if engine is None:
        return "the Mooncake driver was closed before this batch ran"
    src, dst, nbytes = d.src.tolist(), d.dst.tolist(), d.nbytes.tolist()
    messages = [job.notify for job in run if job.notify is not None]
    if not messages:
        call = "batch_transfer_sync_write"
        rc = engine.batch_transfer_sync_write(segment, src, dst, nbytes)
    else:
        call = "batch_transfer_sync with TransferNotify"
        note = TransferNotify(sender, encode_messages(messages))
        rc = engine.batch_transfer_sync(segment, src, dst, nbytes, TransferOpcode.Write, note)
    if rc == 0:
        return None
    text = (
        f"Mooncake {call} of {len(d)} descriptor(s), {d.total_bytes} bytes, to segment "
        f"{segment} returned {explain_transfer(rc)}; "
    )
    probe = _probe(engine, segment)
    if probe is None:
        return text + (
            f"the peer did not answer send_probe within {PROBE_S} s: it is frozen, overloaded "
            "or unreachable (the transfer stalled)"
        )
    if probe == 0:
        return text + (
            "the peer answers send_probe, so it refused the write (a destination outside the "
            "memory that segment holds now: deregistered, or registered again under a new "
            "segment) or the transfer stalled; the engine's log on stderr has the details"
        )
    return text + f"send_probe to it returned {explain(probe)}: the peer is gone or unreachable"


def _moving(d: Descriptors) -> Descriptors:
    """The entries that move bytes; the first (zero-length) one when none does, to carry the
    notification of notifications sent alone."""
    keep = d.nbytes > 0
    if keep.all():
        return d
    if not keep.any():
        keep[1:] = False
        keep[0] = True
    return Descriptors(d.src[keep], d.dst[keep], d.nbytes[keep])


def _probe(engine: TransferEngine, segment: str) -> int | None:
    """``send_probe``'s code, or None when it has not answered within ``PROBE_S``.

    A frozen peer's kernel still accepts the connection, and the engine then
    waits 60 s for its reply: the probe runs on a helper thread so that the
    lane (and with it the failed write) is not held that long.
    """
    result: list[int] = []
    helper = threading.Thread(
        target=lambda: result.append(engine.send_probe(segment)),
        name=f"xferkit-mooncake-probe-{segment}",
        daemon=True,
    )
    helper.start()
    helper.join(PROBE_S)
    return result[0] if result else None
