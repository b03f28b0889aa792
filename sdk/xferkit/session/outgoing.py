"""Outgoing requests (the prefill side): a ``Send`` per request, its chunks written as
destinations are known.

A decode rank's ``Request`` claims its place (TP rank, stage, from its Hello) in the request
for its connection; only that connection may then abort, fail or unpack it. Each chunk of
``Send.write`` maps onto the next unfilled slots of each place, expanded through the pair's
plan and posted (``Post``) with the completion tag on the notification. Chunks written
before a decode rank asked are held (under a lease once the last is in), requests asked for
before ``offer`` within the ledger's bounds. A failing request cancels its writes and is
settled, its ``Fail`` / ``AbortAck`` sent, once every write ended; where the driver's ends
are not final, behind an ``Ended`` notification to each decode rank it wrote to, which lands
after the last of those bytes (``Capabilities.ends_are_final``).
"""

from __future__ import annotations

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError, ProtocolError
from ..planner import Plan
from ..planner.expand import Layers
from . import actions as act
from . import sends, wire
from .core import Out, Settings, log, remember, stage_text
from .layerwise import pool_layers
from .pairs import Down
from .sends import Dst, Ledger, SendRec, refused_claim, reused, rid_of, stale, unpack_slots
from .staged import Stager, check_offer
from .states import RequestError, State

_NOTHING = Descriptors.empty()


class Outgoing:
    """Sends: claims from decode ranks, chunks from the engine, writes, leases, failures."""

    def __init__(self, s: Settings, out: Out) -> None:
        self.s, self.out = s, out
        self.sends: dict[str, SendRec] = {}
        self.failing: dict[str, SendRec] = {}  # failed, writes still ending
        self.writes: dict[int, tuple[SendRec, Dst, float]] = {}  # wid -> (.., when posted)
        self._wid = 0
        self.ledger = Ledger(s.max_unoffered)
        self.stager = Stager(s, self._post, self.fail, lambda: self.now)
        self.layers = pool_layers(s.manifest)  # what a layer-wise chunk owes, per pool

    def _rec(self, rid: str, now: float) -> SendRec:
        rec = self.sends.get(rid)
        if rec is None:
            rec = self.sends[rid] = SendRec(rid, now + self.s.request_timeout_s)
        return rec

    def _reply(self, down: Down, rid: str, gen: int, stage: str, text: str) -> None:
        self.out.send(down.conn, wire.Fail(rid=rid, gen=gen, stage=stage, text=text))

    def request(self, down: Down, msg: wire.Request, now: float) -> None:
        rid, where = msg.rid, self.s.where("prefill")
        if down.error is not None:  # the handshake failed: both sides report its text, but
            stage, text = down.error  # a place another connection claimed is not its to fail
            rec = self.sends.get(rid)
            mine = rec is None or (down.place.pp_rank, down.place.tp_rank) not in rec.dsts
            if mine and self.ledger.root_cause(rid) is None and rid not in self.ledger.finished:
                self._early_failure(rid, RequestError(text, stage=stage, request_id=rid))
            self._reply(down, rid, msg.gen, stage, text)
            return
        failed = self.ledger.root_cause(rid)
        if failed is not None:  # it failed here before this rank asked: the root cause
            self._reply(down, rid, msg.gen, failed.stage, failed.args[0])
            return
        rec = self.sends.get(rid)
        if problem := refused_claim(rec, down, rid, rid in self.ledger.finished):
            self._reply(down, rid, msg.gen, "request", stage_text(rid, "request", where, problem))
            return
        if msg.failed:  # the decode rank failed it before it could ask: its text, its place
            error = RequestError(msg.failed, stage=msg.stage or "request", request_id=rid)
            if rec is None:
                self._early_failure(rid, error)
            else:
                self.fail(rec, error.stage, msg.failed, formatted=True, gone=down)
            return
        if msg.registration != down.generation:
            # Its memory changed since the endpoint we hold: writing through it could land in
            # memory it no longer offers. Fails here, on both sides, before anything is posted.
            text = stage_text(rid, "handshake", where, stale(down, msg))
            self._early_failure(rid, RequestError(text, stage="handshake", request_id=rid))
            self._reply(down, rid, msg.gen, "handshake", text)
            return
        assert down.plan is not None
        if msg.needed == down.plan.empty:
            detail = f"the plans disagree: decode rank {down.place.tp_rank} says it " + (
                "needs this source" if msg.needed else "does not need this source"
            )
            self._reply(down, rid, msg.gen, "plan", stage_text(rid, "plan", where, detail))
            return
        try:
            slots = unpack_slots(msg.slots)
            check_offer(msg, down.plan.manifests[1])
        except ProtocolError as exc:
            self._reply(down, rid, msg.gen, "request", stage_text(rid, "request", where, str(exc)))
            return
        count = sum(s.size for s in slots.values())
        if (rec is None or rec.handle is None) and (busy := self.ledger.hold(rec, count)):
            self._reply(down, rid, msg.gen, "request", stage_text(rid, "request", where, busy))
            return
        rec = self._rec(rid, now)
        place = (down.place.pp_rank, down.place.tp_rank)
        if rec.handle is None:
            self.ledger.keep(rec, count)
        if rec.lease_until is not None:  # claimed: the request's own deadline runs again
            rec.lease_until = None
            rec.deadline = now + self.s.request_timeout_s
        rec.dst_size = (down.place.tp_size, down.place.pp_size)
        dst = rec.dsts[place] = Dst(down, msg, slots)
        self._write_chunks(rec, dst, rec.chunks, now)  # those written already go as one
        self._check(rec)

    def _early_failure(self, rid: str, error: RequestError) -> None:
        rec = self.sends.get(rid)
        if rec is not None:  # held, not offered
            self.fail(rec, error.stage, error.args[0], formatted=True)
        else:
            self.ledger.failed_early(rid, error)

    def remote_fail(self, down: Down, msg: wire.Abort | wire.Fail) -> None:
        """An Abort or Fail, applied only to the place its connection claimed."""
        rec = self.sends.get(msg.rid) or self.failing.get(msg.rid)
        dst = None if rec is None else rec.dst_of(down)
        if rec is None or dst is None or dst.gen != msg.gen:
            log.info(
                "%s: %s for %r from %s, which claimed no part of it: dropped",
                self.s.address, type(msg).__name__, msg.rid, down.where(),
            )  # fmt: skip
            if isinstance(msg, wire.Abort):  # nothing of it is in flight towards that rank
                self.out.send(down.conn, wire.AbortAck(rid=msg.rid, gen=msg.gen))
            return
        if rec.error is not None:
            return  # failing already: its Fail, once drained, answers this
        if isinstance(msg, wire.Abort):
            self.fail(rec, msg.stage, msg.text, formatted=True, ack=down)
        else:
            self.fail(rec, msg.stage, msg.text, formatted=True, gone=down)

    def unpacked(self, down: Down, msg: wire.Unpacked) -> None:
        rec = self.sends.get(msg.rid)
        dst = None if rec is None else rec.dst_of(down)
        if rec is None or dst is None or not self.stager.unpacked(rec, dst, msg):
            say = log.debug if msg.rid in self.ledger.finished else log.info  # after DONE: usual
            say("%s: Unpacked for %r, not staging: dropped", self.s.address, msg.rid)
            return
        self._check(rec)

    def renew(self, rids: list[str], now: float) -> None:
        for rid in rids:
            rec = self.sends.get(rid)
            if rec is not None and rec.lease_until is not None:
                rec.lease_until = now + self.s.lease_s
            else:
                log.info("%s: renewal of %r, which is not held: dropped", self.s.address, rid)

    def offer(self, handle: object, rid: str, now: float) -> None:
        early = self.ledger.early.pop(rid, None)
        if early is not None:  # decode ranks asking after this get the same root cause
            remember(self.ledger.failed, rid, early)
        # A used id fails as its decode ranks are told: a failed one with its root cause.
        error = early or self.ledger.failed.get(rid)
        if error is not None or rid in self.ledger.finished:
            text = stage_text(rid, "request", self.s.where("prefill"), reused(rid))
            self.out.failed(handle, error or RequestError(text, stage="request", request_id=rid))
            return
        rec = self._rec(rid, now)
        rec.handle = handle
        self.ledger.unhold(rec)
        rec.deadline = now + self.s.request_timeout_s
        if rec.dsts:
            self.out.move(handle, State.WAITING)
        self._check(rec)

    def write(
        self, handle: object, slots: dict[str, np.ndarray], last: bool, layers: Layers, now: float
    ) -> None:
        rec = self.sends.get(rid_of(handle))
        if rec is None or rec.handle is not handle or rec.error is not None:
            return
        rec.chunks.append((slots, last, layers))
        rec.last = last
        if last and not rec.dsts:  # prefill finished first: hold under a lease
            rec.lease_until = now + self.s.lease_s
        for dst in rec.dsts.values():
            self._write_chunks(rec, dst, [(slots, last, layers)], now)
            if rec.error is not None:
                return
        self._check(rec)

    def abort(self, handle: object) -> None:
        rec = self.sends.get(rid_of(handle))
        if rec is not None and rec.handle is handle:
            self.fail(rec, "abort", "aborted by the engine")

    def _write_chunks(self, rec: SendRec, dst: Dst, todo: list[sends.Written], now: float) -> None:
        plan = dst.down.plan
        assert plan is not None
        runs = dst.take_runs(todo, plan, self.layers)
        if isinstance(runs, str):
            self.fail(rec, "plan", runs)
            return
        for run in runs:
            dst.last = dst.last or run.last  # before its writes: they carry the total
            if rec.error is None and dst.needed:
                self._write_run(rec, dst, plan, run, now)

    def _write_run(self, rec: SendRec, dst: Dst, plan: Plan, run: sends.Run, now: float) -> None:
        (request, spans), layers = run.mapped, run.layers
        began = self.s.clock()
        staged = self.stager.chunk(rec, dst, request, spans, layers)
        if staged is not None:
            descs = staged.direct
            dst.planned += staged.rounds
        else:
            try:
                descs = plan.expand(request, layers)
            except PlanError as exc:
                self.fail(rec, "plan", f"slots named by {dst.down.where()}: {exc}")
                return
        rec.timeline.add("plan", began, self.s.clock())
        rec.counted(descs, None if staged is None else staged.staged_bytes, run.chunks)
        # The last chunk's writes announce the total; with none to post, an empty one does.
        if len(descs) or (run.last and not self.stager.unposted(dst)):
            dst.planned += 1
            self._post(rec, dst, descs, None, now)
        if staged is not None:
            self.stager.pump(rec, dst)

    def _post(
        self, rec: SendRec, dst: Dst, descs: Descriptors, r: wire.Round | None, now: float = -1.0
    ) -> None:
        """One write to ``dst`` with its completion tag (the total on every write once known)."""
        if rec.error is not None:
            return
        now = self.now if now < 0 else now
        total = dst.planned if dst.last else 0
        tag = wire.Tag(rec.rid, dst.gen, self.s.manifest.tp_rank, dst.seq, total, r)
        dst.seq += 1
        note = wire.encode(tag) if self.s.notifying else None
        wid = self._posting(dst, descs, note, rec.deadline - now, now)
        self.writes[wid] = (rec, dst, now)
        dst.pending[wid] = tag
        dst.down.writes += 1
        rec.descriptors[r is not None] += len(descs)
        rec.writes += 1
        if rec.handle is not None and not rec.transferring:
            rec.transferring = True
            self.out.move(rec.handle, State.TRANSFERRING)

    def _posting(
        self, dst: Dst, descs: Descriptors, note: bytes | None, left: float, now: float
    ) -> int:
        """Post ``descs`` to ``dst``'s rank within ``left`` seconds; the write's id."""
        self._wid += 1
        horizon = max(self.s.dead_after_s - self.s.heartbeat_s, 0.001)
        post = act.Post(self._wid, dst.down.peer, descs, note, max(left, 0.001), now, horizon)
        self.out.add(post)
        return self._wid

    now = 0.0  # the time of the call in progress (set by the Protocol on every entry)

    def write_ended(self, wid: int, error: str, post_s: float = 0.0) -> Down | None:
        """Write ``wid`` left the driver (``error``: it failed); the down that may now be
        disconnected, if it was lost and this was its last write."""
        got = self.writes.pop(wid, None)
        if got is None:
            return None
        rec, dst, posted = got
        rec.timeline.add("post", posted, posted + post_s)
        rec.timeline.add("wire", posted, self.now)
        tag = dst.pending.pop(wid)
        dst.down.writes -= 1
        lost = dst.down if dst.down.lost and dst.down.writes == 0 else None
        if rec.error is not None:
            if not rec.pending:
                self._settle(rec)
            return lost
        if error:  # the driver's text names its own peer: say whose rank that is
            self.fail(rec, "transfer", f"writing to {dst.down.where()}: {error}")
            return lost
        if not self.s.notifying:
            self.out.send(dst.down.conn, wire.written(tag))
        elif dst.down.pokes:
            self.out.send(dst.down.conn, wire.Poke())
        if tag.round is not None:  # its source half is free: pack the next
            self.stager.written(rec, dst, tag.round)
        self._check(rec)
        return lost

    def pump(self, rid: str) -> None:
        rec = self.sends.get(rid)
        if rec is None or rec.error is not None:
            return
        for dst in list(rec.dsts.values()):
            self.stager.pump(rec, dst)
        self._check(rec)

    def _check(self, rec: SendRec) -> None:
        if rec.error is not None or rec.handle is None or not rec.last or rec.dst_size is None:
            return
        if len(rec.dsts) < rec.dst_size[0] * rec.dst_size[1]:
            return
        for dst in rec.dsts.values():
            if not dst.last or dst.pending or self.stager.unfinished(dst):
                return
        self.stager.release(rec)
        del self.sends[rec.rid]
        remember(self.ledger.finished, rec.rid, None)
        self.out.routed(rec.handle, rec.routes, rec.timeline)
        self.out.done(rec.handle, rec.rid)

    def fail(
        self, rec: SendRec, stage: str, detail: str, *, formatted: bool = False,
        ack: Down | None = None, gone: Down | None = None,
    ) -> None:  # fmt: skip
        """Cancel ``rec``'s writes; once they left the driver, report the root cause to the
        engine and every decode rank of the request (``ack`` gets an ``AbortAck`` instead,
        ``gone`` nothing)."""
        if rec.error is not None:
            return
        text = detail if formatted else stage_text(rec.rid, stage, self.s.where("prefill"), detail)
        rec.error = RequestError(text, stage=stage, request_id=rec.rid)
        rec.ack, rec.gone = ack, gone
        del self.sends[rec.rid]
        self.ledger.unhold(rec)
        remember(self.ledger.failed, rec.rid, rec.error)
        if rec.handle is not None:
            self.out.failing(rec.handle, rec.error)
        for dst in rec.dsts.values():
            for wid in dst.pending:
                self.out.add(act.Cancel(wid, text))
        if rec.pending:
            self.failing[rec.rid] = rec
        else:
            self._settle(rec)

    def _settle(self, rec: SendRec) -> None:
        assert rec.error is not None
        self.failing.pop(rec.rid, None)
        self.stager.release(rec)  # every write of it ended: nothing reads the slices
        if rec.handle is not None:  # the engine learns first: a peer's answer may be read at once
            self.out.routed(rec.handle, rec.routes, rec.timeline)
            self.out.failed(rec.handle, rec.error)
        else:  # not offered yet: offer() will report it
            self.ledger.failed_early(rec.rid, rec.error)
        ack, gone = rec.ack, rec.gone
        for dst in rec.dsts.values():  # a rank lost here (its Bye, its silence) still
            if dst.down is gone:  # waits for this answer: only a closed connection does not
                continue
            barrier = self._barrier(rec, dst)
            if dst.down is ack:
                msg: wire.Message = wire.AbortAck(rid=rec.rid, gen=dst.gen, barrier=barrier)
            else:
                stage, text = rec.error.stage, rec.error.args[0]
                msg = wire.Fail(rid=rec.rid, gen=dst.gen, stage=stage, text=text, barrier=barrier)
            self.out.send(dst.down.conn, msg)

    def _barrier(self, rec: SendRec, dst: Dst) -> bool:
        """Post an ``Ended`` notification behind ``rec``'s writes to ``dst`` where the driver
        may still deliver them after they ended (its release lets queued puts go out): it
        lands after their last byte, and the decode rank waits for it. True when posted."""
        s = self.s
        if s.ends_are_final or not s.notifying or dst.seq == 0 or dst.down.peer is None:
            return False
        note = wire.encode(wire.Ended(rec.rid, dst.gen))  # not in ``writes``: nobody waits
        self._posting(dst, _NOTHING, note, s.dead_after_s, self.now)  # for its end here
        return True

    def down_lost(self, down: Down, why: str, bye: bool = False) -> bool:
        """Fail every request ``down`` has a part in, but after its ``Bye`` not one whose writes
        to it are all posted (their completions decide: it may have closed at DONE); True when
        nothing of ours still writes to it (so it may be disconnected now)."""
        down.lost = True
        for rec, dst in [(r, r.dst_of(down)) for r in list(self.sends.values())]:
            if dst is not None and not (bye and dst.last and not self.stager.unposted(dst)):
                self.fail(rec, "peer lost", why, gone=down)
        return down.writes == 0

    def tick(self, now: float) -> None:
        for rec in list(self.sends.values()):
            if rec.lease_until is not None:
                if now > rec.lease_until:
                    self.fail(
                        rec,
                        "timeout",
                        f"written and held, but no decode rank claimed it within "
                        f"lease_s={self.s.lease_s} (nothing was written)",
                    )
            elif now > rec.deadline:
                why = f"not done within request_timeout_s={self.s.request_timeout_s}"
                self.fail(rec, "timeout", why)

    def next_deadline(self) -> float:
        ends = (r.deadline if r.lease_until is None else r.lease_until for r in self.sends.values())
        return min(ends, default=float("inf"))
