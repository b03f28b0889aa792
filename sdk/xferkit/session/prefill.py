"""The prefill side: a ``Send`` per request, its chunks written as destinations are known.

Each decode rank's ``Request`` names its slots; each chunk of ``Send.write``
maps onto the next unfilled ones, expanded through the pair's plan and
written with the completion tag riding on the notification. Chunks written
before the decode side asked are held, under a lease once the last one is
in. A failing request aborts its writes without waiting (``Transfer.abort``
with ``wait=False``) and is settled, its ``Fail`` / ``AbortAck`` sent, once
every write reports terminal on a later pass of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..descriptors import Descriptors
from ..driver import Status
from ..errors import PlanError, XferError
from ..transfer import Transfer
from . import wire
from .core import DRAIN_S, POLL_S, log, remember, stage_text
from .handles import RequestError, Send, State
from .handshake import Down
from .rounds import Halves
from .staged import Chunk, StagedWrites, dst_of

_NONE = np.zeros(0, dtype=np.int64)


class Dst:
    """One decode rank's part of a prefill request."""

    def __init__(self, down: Down, msg: wire.Request) -> None:
        self.down = down
        self.gen = msg.gen
        self.needed = msg.needed
        self.slots = {p: np.asarray(s, dtype=np.int64) for p, s in msg.slots.items()}
        self.cursor = dict.fromkeys(self.slots, 0)
        self.seq = 0  # writes posted
        self.planned = 0  # writes posted or still to post (staged rounds): the total, once last
        self.last = False
        self.transfers: list[tuple[Transfer, wire.Tag | None]] = []  # tag None: completed
        self.staging, self.staging_bytes = msg.staging, msg.staging_bytes  # its slice for us
        self.chunks = 0
        self.staged: dict[int, Chunk] = {}
        self.halves = Halves()  # of its slice, shared by the staged chunks


class SendRec:
    """A prefill request as the I/O thread tracks it."""

    def __init__(self, rid: str, deadline: float) -> None:
        self.rid = rid
        self.handle: Send | None = None
        self.dsts: dict[tuple[int, int], Dst] = {}  # (pipeline stage, TP rank) -> its part
        self.dst_size: tuple[int, int] | None = None  # decode (TP size, pipeline stages)
        self.chunks: list[tuple[dict[str, np.ndarray], bool]] = []
        self.last = False
        self.deadline = deadline
        self.lease_until: float | None = None  # set while written, held and unclaimed
        self.error: RequestError | None = None


class Drain:
    """Aborted writes still leaving the driver, and what to do once they have."""

    def __init__(
        self,
        rid: str | None,
        transfers: list[Transfer],
        then: Callable[[], None],
        answers: frozenset[bytes] = frozenset(),
    ) -> None:
        self.rid = rid
        self.answers = answers  # the decode ranks ``then`` answers
        self.transfers = transfers
        self.then = then
        self.deadline = time.monotonic() + DRAIN_S

    def settled(self, now: float) -> bool:
        pending = [t for t in self.transfers if t.poll() is Status.PENDING]
        if pending and now > self.deadline:
            log.error(
                "request %r: %d aborted writes still in the driver after %s s; going on",
                self.rid,
                len(pending),
                DRAIN_S,
            )
            return True
        return not pending


class PrefillSide(StagedWrites):
    """Sends: requests from decode ranks, chunks from the engine, writes, leases, drains."""

    def _on_down_message(self, down: Down, msg: wire.Message) -> None:
        if isinstance(msg, wire.Ping):
            if msg.incarnation != down.hello.incarnation:
                log.warning(
                    "%s: ping with a changed incarnation from %s: dropped",
                    self.address,
                    down.where(),
                )
                return
            self._to_down(down.ident, wire.Pong(incarnation=self.incarnation))
        elif isinstance(msg, wire.Request):
            self._on_request(down, msg)
        elif isinstance(msg, wire.Abort | wire.Fail):
            self._on_remote_fail(down, msg)
        elif isinstance(msg, wire.Unpacked):
            self._on_unpacked(down, msg)
        elif isinstance(msg, wire.Renew):
            for rid in msg.rids:
                rec = self._sends.get(rid)
                if rec is not None and rec.lease_until is not None:
                    rec.lease_until = time.monotonic() + self.lease_s
                else:
                    log.info("%s: renewal of %r, which is not held: dropped", self.address, rid)
        elif isinstance(msg, wire.Bye):
            self._lose_down(down, f"{down.where()} closed its session: {msg.reason}")
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped", self.address, type(msg).__name__, down.where()
            )

    def _send_rec(self, rid: str) -> SendRec:
        rec = self._sends.get(rid)
        if rec is None:
            rec = self._sends[rid] = SendRec(rid, time.monotonic() + self.request_timeout_s)
        return rec

    def _on_request(self, down: Down, msg: wire.Request) -> None:
        def fail(stage: str, text: str) -> None:
            self._to_down(down.ident, wire.Fail(rid=msg.rid, gen=msg.gen, stage=stage, text=text))

        failed = self._failed.get(msg.rid) or self._early.get(msg.rid)
        if failed is not None:  # it failed here before this rank asked: the root cause
            fail(failed.stage, failed.args[0])
            return
        problem = None
        if msg.rid in self._finished:
            problem = f"request id {msg.rid!r} was already used with this prefill rank"
        elif down.error is not None:  # the handshake failed: both sides report its text
            fail(*down.error)
            return
        elif down.peer is not None and msg.registration != down.peer.generation:
            # Its memory changed since the endpoint we hold: writing through it could land in
            # memory it no longer offers (UCX on one host cannot refuse). The Session owns its
            # registration, so an engine re-registered underneath it: the request fails here,
            # on both sides, before anything is posted.
            detail = (
                f"decode rank {down.hello.tp_rank} re-registered its memory since the handshake "
                f"(registration {down.peer.generation}, now {msg.registration}): the endpoint "
                "this rank holds is stale, so nothing is written through it"
            )
            text = stage_text(msg.rid, "handshake", self.where("prefill"), detail)
            live = self._sends.get(msg.rid)
            if live is not None:
                self._fail_send(live, "handshake", text, formatted=True)
            else:
                remember(
                    self._early, msg.rid, RequestError(text, stage="handshake", request_id=msg.rid)
                )
            fail("handshake", text)
            return
        elif (
            msg.dst_rank != down.hello.tp_rank
            or msg.dst_size != down.hello.tp_size
            or msg.dst_stage >= msg.dst_stages
        ):
            problem = (
                f"decode rank {down.hello.tp_rank} sent a request as rank "
                f"{msg.dst_rank}/{msg.dst_size} of stage {msg.dst_stage}/{msg.dst_stages}"
            )
        rec = self._sends.get(msg.rid)
        key = (msg.dst_stage, msg.dst_rank)
        if problem is None and rec is not None and key in rec.dsts:
            problem = (
                f"request id {msg.rid!r} was already used by decode rank {msg.dst_rank} "
                "(a second Request for it)"
            )
        shape = (msg.dst_size, msg.dst_stages)
        if problem is None and rec is not None and rec.dst_size not in (None, shape):
            problem = (
                f"decode ranks disagree on their TP size x pipeline stages ({rec.dst_size} and "
                f"{shape})"
            )
        if problem is not None:
            fail("request", stage_text(msg.rid, "request", self.where("prefill"), problem))
            return
        assert down.plan is not None
        if msg.needed == down.plan.empty:
            detail = (
                f"the plans disagree: decode rank {msg.dst_rank} says it "
                f"{'needs' if msg.needed else 'does not need'} this source"
            )
            fail("plan", stage_text(msg.rid, "plan", self.where("prefill"), detail))
            return
        rec = self._send_rec(msg.rid)
        if rec.lease_until is not None:  # claimed: the request's own deadline runs again
            rec.lease_until = None
            rec.deadline = time.monotonic() + self.request_timeout_s
        rec.dst_size = shape
        dst = rec.dsts[key] = Dst(down, msg)
        for slots, last in rec.chunks:
            if rec.error is None:
                self._write_chunk(rec, dst, slots, last)
        self._check_send(rec)

    def _on_offer(self, handle: Send) -> None:
        rid = handle.request_id
        early = self._early.pop(rid, None)
        if early is not None:  # decode ranks asking after this get the same root cause
            remember(self._failed, rid, early)
        if early is not None or rid in self._finished:
            handle._fail(
                early
                or RequestError(
                    f"request {rid!r} already finished here", stage="request", request_id=rid
                )
            )
            self._finish(rid)
            return
        rec = self._send_rec(rid)
        rec.handle = handle
        rec.deadline = time.monotonic() + self.request_timeout_s
        if rec.dsts:
            handle._move(State.WAITING)
        self._check_send(rec)

    def _on_write(self, handle: Send, slots: dict[str, np.ndarray], last: bool) -> None:
        rec = self._sends.get(handle.request_id)
        if rec is None or rec.handle is not handle or rec.error is not None:
            return
        rec.chunks.append((slots, last))
        rec.last = last
        if last and not rec.dsts:  # prefill finished first: hold under a lease
            rec.lease_until = time.monotonic() + self.lease_s
        for dst in rec.dsts.values():
            self._write_chunk(rec, dst, slots, last)
            if rec.error is not None:
                return
        self._check_send(rec)

    def _write_chunk(
        self, rec: SendRec, dst: Dst, slots: dict[str, np.ndarray], last: bool
    ) -> None:
        request: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        spans: dict[str, tuple[int, int, int]] = {}
        assert dst.down.plan is not None
        for pool, src in slots.items():
            have = dst.slots.get(pool, _NONE)
            at = dst.cursor.get(pool, 0)
            pages = dst.down.plan.pages(pool)
            if pages is None:  # no region of it here (another pipeline stage's): none of ours
                continue
            count, problem = _dst_count(src.size, pages, last)
            room = have.size - at
            if not problem and count > room:
                problem = f"{dst.down.where()} has {room} destination slots left"
                if count - room < pages[0]:
                    count, problem = room, ""  # the last source slot's pages nobody asked for
            if problem:
                detail = f"a chunk names {src.size} slots of pool {pool!r}: {problem}"
                self._fail_send(rec, "plan", detail)
                return
            request[pool] = (src, have[at : at + count])
            spans[pool] = (at, count, src.size)
            dst.cursor[pool] = at + count
        if last:
            # Pools no region of this pair holds (another pipeline stage's) are not ours to fill.
            paired = dst.down.plan.pages
            short = [
                p for p, s in dst.slots.items() if dst.cursor[p] != s.size and paired(p) is not None
            ]
            if short:
                p = short[0]
                self._fail_send(
                    rec,
                    "plan",
                    f"the last chunk leaves {dst.slots[p].size - dst.cursor[p]} "
                    f"destination slots of pool {p!r} of {dst.down.where()} unwritten",
                )
                return
            dst.last = True
        if not dst.needed:
            return
        assert dst.down.plan is not None and dst.down.peer is not None
        staged = self._stage_chunk(rec, dst, request, spans)
        chunk = None
        if staged is not None:
            descs, chunk = staged
            dst.planned += chunk.out.rounds
        else:
            try:
                descs = dst.down.plan.expand(request)
            except PlanError as exc:
                self._fail_send(rec, "plan", f"slots named by {dst.down.where()}: {exc}")
                return
        # The last chunk's writes announce the total; with none to post, an empty one does.
        if len(descs) or (last and not any(c.out.next < c.out.rounds for c in dst.staged.values())):
            dst.planned += 1
            self._post(rec, dst, descs, None)
        if chunk is not None:
            self._pump(rec, dst)

    def _post(self, rec: SendRec, dst: Dst, descs: Descriptors, r: wire.Round | None) -> None:
        """One write to ``dst`` with its completion tag (the total on every write once known)."""
        assert dst.down.peer is not None
        total = dst.planned if dst.last else 0
        tag = wire.Tag(rec.rid, dst.gen, self.manifest.tp_rank, dst.seq, total, r)
        dst.seq += 1
        now = time.monotonic()
        left = max(rec.deadline - now, 0.001)
        try:
            transfer = self.backend.write(
                dst.down.peer, descs, wire.encode(tag) if self._notifying else None, timeout=left
            )
        except XferError as exc:
            self._fail_send(rec, "transfer", f"writing to {dst.down.where()}: {exc}")
            return
        dst.transfers.append((transfer, tag))
        self._posted = True
        prev, self._last_write = self._last_write, transfer
        if prev is not None and prev.poll() is Status.PENDING:
            self._behind = True  # the driver has not caught up with the previous write
        if not self._writing:  # nothing to learn from polling it at once
            self._poll_at = now + POLL_S
        self._writing[rec.rid] = rec
        if rec.handle is not None:
            rec.handle._move(State.TRANSFERRING)

    def _poll_transfers(self) -> None:
        """Poll the writes in flight (only theirs: held and waiting sends cost nothing)."""
        for rec in list(self._writing.values()):
            pending = False
            for dst in rec.dsts.values():
                for i, (t, tag) in enumerate(dst.transfers):
                    if tag is None:
                        continue
                    st = t.poll()
                    if st is Status.PENDING:
                        pending = True
                    elif st is Status.FAILED:
                        self._fail_send(rec, "transfer", str(t.error))
                        break
                    else:
                        if not self._notifying:
                            self._to_down(dst.down.ident, wire.written(tag))
                        dst.transfers[i] = (t, None)
                        if tag.round is not None:  # its source half is free: pack the next
                            self._round_written(rec, dst, tag.round)
                if rec.error is not None:
                    break
            if rec.error is None:
                if not pending:
                    del self._writing[rec.rid]
                self._check_send(rec)

    def _check_send(self, rec: SendRec) -> None:
        if rec.error is not None or rec.handle is None or not rec.last or rec.dst_size is None:
            return
        if len(rec.dsts) < rec.dst_size[0] * rec.dst_size[1]:
            return
        for dst in rec.dsts.values():
            if not dst.last or any(tag is not None for _, tag in dst.transfers):
                return
            if any(c.out.complete < c.out.rounds for c in dst.staged.values()):
                return
        self._release_staging(rec)
        self._done(rec.handle, self._sends)

    def _fail_send(
        self,
        rec: SendRec,
        stage: str,
        detail: str,
        *,
        formatted: bool = False,
        ack: Down | None = None,
        gone: Down | None = None,
    ) -> None:
        """Abort ``rec``'s writes; once they left the driver, report the root cause to the
        engine and every decode rank of the request (``ack`` gets an ``AbortAck`` instead,
        ``gone`` nothing)."""
        if rec.error is not None:
            return
        text = detail if formatted else stage_text(rec.rid, stage, self.where("prefill"), detail)
        error = rec.error = RequestError(text, stage=stage, request_id=rec.rid)
        del self._sends[rec.rid]
        self._writing.pop(rec.rid, None)
        remember(self._failed, rec.rid, error)
        transfers = [t for dst in rec.dsts.values() for t, _ in dst.transfers]
        for t in transfers:
            try:
                t.abort(text, wait=False)
            except XferError as exc:
                log.error("%s: %s", self.address, exc)

        def settle() -> None:
            self._release_staging(rec)  # every write of it ended: nothing reads the slices
            for dst in rec.dsts.values():
                if dst.down is gone or self._downs.get(dst.down.ident) is not dst.down:
                    continue
                if dst.down is ack:
                    self._to_down(dst.down.ident, wire.AbortAck(rid=rec.rid, gen=dst.gen))
                else:
                    msg = wire.Fail(rid=rec.rid, gen=dst.gen, stage=stage, text=text)
                    self._to_down(dst.down.ident, msg)
            if rec.handle is not None:
                rec.handle._fail(error)
                self._finish(rec.rid)
            else:  # not offered yet: offer() will report it
                remember(self._early, rec.rid, error)

        answers = frozenset(d.down.ident for d in rec.dsts.values() if d.down is not gone)
        drain = Drain(rec.rid, transfers, settle, answers)
        if drain.settled(time.monotonic()):
            settle()
        else:
            self._drains.append(drain)

    def _poll_drains(self) -> None:
        now = time.monotonic()
        for drain in [d for d in self._drains if d.settled(now)]:
            self._drains.remove(drain)
            drain.then()

    def _on_remote_fail(self, down: Down, msg: wire.Abort | wire.Fail) -> None:
        rec = self._sends.get(msg.rid)
        dst = None if rec is None else dst_of(rec, down)
        if rec is None or (dst is not None and dst.gen != msg.gen):
            if any(d.rid == msg.rid and down.ident in d.answers for d in self._drains):
                return  # failing already: its Fail, once drained, answers this
            known = msg.rid in self._finished or msg.rid in self._early or msg.rid in self._failed
            if not known:
                err = RequestError(
                    msg.text, stage=msg.stage, request_id=msg.rid, peer=down.hello.address
                )
                remember(self._early, msg.rid, err)  # offer() after this reports it
            else:
                log.info(
                    "%s: late %s for request %r: dropped", self.address, type(msg).__name__, msg.rid
                )
            if isinstance(msg, wire.Abort):
                self._to_down(down.ident, wire.AbortAck(rid=msg.rid, gen=msg.gen))
            return
        if isinstance(msg, wire.Abort):
            if dst is None:  # we never wrote for it: nothing in flight
                self._to_down(down.ident, wire.AbortAck(rid=msg.rid, gen=msg.gen))
            self._fail_send(rec, msg.stage, msg.text, formatted=True, ack=down)
        else:
            self._fail_send(rec, msg.stage, msg.text, formatted=True, gone=down)


def _dst_count(n: int, pages: tuple[int, int], last: bool) -> tuple[int, str]:
    """Destination slots ``n`` source slots fill, or why a chunk cannot end there: a
    destination slot holding several source pages is written by one chunk, unless it is last."""
    ks, kd = pages
    count = -(-n * ks // kd)
    if n * ks % kd and not last:
        return count, (
            f"a destination slot holds {kd} source slots, so every chunk but the last names a "
            f"multiple of {kd}"
        )
    return count, ""
