"""The prefill side of staged chunks: pack rounds, post them as halves free up, count them.

A chunk goes staged when its pair's routes stage some pool it names: it packs
into a piece of this rank's staging sized to its rounds, and unpacks from the
piece the decode rank offered in its ``Request``. A chunk that finds this
rank's staging full waits for a piece, oldest first (the time it waited is
counted on its request), rather than take a route the cost model priced far
worse: its request's deadline bounds the wait. Each round is one write whose
tag names its chunk and round; the decode rank unpacks it on arrival and
answers ``Unpacked``, which frees that half of its piece for round k+2. Packs
run off the control thread (``Settings.runner``), so that round k+1 packs while
round k is posted; a finished pack comes back as ``Protocol.pump``. A chunk
written while the one before it to the same decode rank has not started joins
it: under load most chunks wait, and each one's fixed cost on both ranks (its
cut, pack, write, notification, unpack) was the load's bound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError, ProtocolError
from ..manifest import STAGING_POOL, Manifest
from ..planner.expand import Layers
from ..staging import StagedPlan, StagedRequest
from . import wire
from .core import Settings, log
from .rounds import Outbound, Runner, aligned
from .sends import Chunk, Dst, SendRec, joined


class Planned(NamedTuple):
    """A chunk as the stager planned it: what it writes direct, and the rounds and staging
    bytes it added (to a chunk it joined, or its own)."""

    direct: Descriptors
    rounds: int
    staged_bytes: int


def check_offer(msg: wire.Request, manifest: Manifest) -> None:
    """A ``ProtocolError`` unless the piece of staging ``msg`` offers (if any) lies within the
    staging region its decode rank advertised: a piece elsewhere, even in a region of its own
    (a KV pool), would have staged rounds land in slots that the offer never gave."""
    at, size = msg.staging, msg.staging_bytes
    if not at:
        return  # none offered: its chunks go direct
    r = manifest.nearest(at)  # O(log regions)
    end = r.addr + r.nbytes if r is not None else 0
    if r is not None and r.pool == STAGING_POOL and size > 0 and r.addr <= at <= end - size:
        return
    raise ProtocolError(
        f"the staging it offered, [{at:#x}, +{size}), is not within the staging it advertised"
    )


def _sealed(copies: Descriptors, dst: Dst) -> Descriptors:
    """A round's wire copies sealed to the pair's manifests, as a plan seals direct writes, so
    that the backend does not scan their bounds again (8% of a prefill rank's CPU under load):
    their slots come from the plan's arithmetic, the source's halves from this rank's piece of
    its staging, the decode rank's from the piece it offered, which ``check_offer`` bound
    to the staging it advertised on arrival."""
    plan = dst.down.plan
    assert plan is not None  # a request is accepted on a pair that planned
    whole = np.concatenate((copies.src, copies.dst, copies.nbytes))
    return Descriptors.sealed_copy(whole, *plan.manifests)


def _bytes(req: StagedRequest) -> int:
    return sum(max(r.src_bytes, r.dst_bytes) for r in req.rounds)


PostRound = Callable[[SendRec, Dst, Descriptors, wire.Round], None]
FailSend = Callable[[SendRec, str, str], None]


class Stager:
    """Staged chunks of the Sends: planning, posting rounds, credits, giving staging back."""

    def __init__(
        self, s: Settings, post: PostRound, fail: FailSend, clock: Callable[[], float]
    ) -> None:
        self.s, self._post, self._fail, self._clock = s, post, fail, clock
        self._waiting: deque[tuple[SendRec, Dst, Chunk]] = deque()  # for a piece, oldest first

    def _runner(self, rid: str) -> Runner | None:
        run = self.s.runner
        if run is None:
            return None
        return lambda d: run(rid, d)

    def chunk(
        self,
        rec: SendRec,
        dst: Dst,
        request: Mapping[str, tuple[np.ndarray, np.ndarray]],
        at: dict[str, tuple[int, int, int]],
        layers: Layers = None,
    ) -> Planned | None:
        """The chunk's direct part and its staged rounds, or None when it goes direct."""
        staged = dst.down.staged
        if staged is None or not staged.staged or self.s.copier is None:
            return None
        pools = list(request)
        packs, unpacks = staged.packs(pools), staged.unpacks(pools)
        if not (packs or unpacks) or (unpacks and not dst.staging):
            return None
        joined = self._join(rec, dst, request, at, layers)
        if joined is not None:
            return joined
        try:
            req = self._cut(staged, dst, request, layers=layers)
        except PlanError as exc:
            log.warning("%s: staging request %r: %s; going direct", self.s.address, rec.rid, exc)
            return None
        chunk = Chunk(dst.chunks, self._outbound(rec, dst, req, packs), 0, at, layers, request)
        dst.chunks += 1
        dst.staged[chunk.index] = chunk
        self._needs(rec, dst, chunk)
        return Planned(req.direct, len(req.rounds), _bytes(req))

    def _cut(
        self,
        staged: StagedPlan,
        dst: Dst,
        request: Mapping[str, tuple[np.ndarray, np.ndarray]],
        direct: bool = True,
        layers: Layers = None,
    ) -> StagedRequest:
        """``request``'s rounds within half this rank's slice and half the decode rank's."""
        half, dst_half = self.s.arena.half, dst.staging_bytes // 2
        return staged.expand(
            request, src_capacity=half, dst_capacity=dst_half, direct=direct, layers=layers
        )

    def _outbound(self, rec: SendRec, dst: Dst, req: StagedRequest, packs: bool) -> Outbound:
        # Two halves where rounds alternate, one where a single round holds the chunk.
        half = min(aligned(req.src_bytes), self.s.arena.half) if packs else 0
        assert self.s.copier is not None  # a Session without one stages nothing
        runner = self._runner(rec.rid) if packs else None
        return Outbound(
            req, 0, dst.staging, half, dst.staging_bytes // 2, dst.halves, self.s.copier, runner
        )

    def _needs(self, rec: SendRec, dst: Dst, chunk: Chunk) -> None:
        """Queue ``chunk`` for its piece of staging, if it packs and does not wait already."""
        need = chunk.out.half * min(chunk.out.rounds, 2)  # within the slice: a piece comes
        waiting, chunk.need = chunk.need, need
        if need and not waiting:
            chunk.waiting_since = self._clock()
            self._waiting.append((rec, dst, chunk))
            for r, d in self._serve():
                if d is not dst:  # the caller pumps this one
                    self.pump(r, d)

    def _join(
        self,
        rec: SendRec,
        dst: Dst,
        request: Mapping[str, tuple[np.ndarray, np.ndarray]],
        at: dict[str, tuple[int, int, int]],
        layers: Layers,
    ) -> Planned | None:
        """Fold a chunk into the one before it to the same decode rank, while none of that one
        has started (it waits for staging, or for the decode rank's halves): one cut, pack,
        write, notification and unpack then serve both. Under load an engine writes chunks
        faster than staging frees, and a chunk's fixed cost on both ranks bounds the load
        (docs/performance.md). The decode rank cannot tell: the joined chunk's spans are
        the two spans end to end, and it cuts the same rounds from them."""
        prev = dst.staged.get(dst.chunks - 1)
        if (
            layers is not None
            or prev is None
            or prev.layers is not None
            or prev.slice
            or prev.out.next
            or prev.out.packing is not None
            or prev.out.rounds > 2  # past both halves: cut again for every chunk that
            # joins, it would cost the square of a long chunked prefill's chunks
        ):
            return None
        mapped = joined([(prev.request, prev.at), (request, at)])
        if mapped is None:
            return None
        both, spans = mapped
        staged = dst.down.staged
        assert staged is not None
        try:
            req = self._cut(staged, dst, both, direct=False)
            direct = staged.expand_direct(request)
        except PlanError:
            return None  # cut on its own, which says why
        before, rounds = _bytes(prev.out.req), prev.out.rounds
        prev.out = self._outbound(rec, dst, req, staged.packs(both))
        prev.request, prev.at = both, spans
        self._needs(rec, dst, prev)
        return Planned(direct, len(req.rounds) - rounds, _bytes(req) - before)

    def _serve(self) -> list[tuple[SendRec, Dst]]:
        """Give pieces to waiting chunks, oldest first, while they fit; their sends."""
        woken = []
        now = self._clock()
        while self._waiting:
            rec, dst, chunk = self._waiting[0]
            if rec.error is None and dst.staged.get(chunk.index) is chunk and chunk.need:
                start = self.s.arena.take(chunk.need)
                if start is None:
                    break
                chunk.slice = chunk.out.src = start
                rec.staging_wait_s += now - chunk.waiting_since
                woken.append((rec, dst))
            self._waiting.popleft()
        return woken

    def _give(self, chunk: Chunk) -> None:
        if chunk.slice:
            self.s.arena.give(chunk.slice)
            chunk.slice = 0
        chunk.need = 0
        for rec, dst in self._serve():
            self.pump(rec, dst)

    def pump(self, rec: SendRec, dst: Dst) -> None:
        """Post every round whose halves are free, oldest chunk first (they share the decode
        rank's halves); give back the slices of chunks whose writes all completed, and let
        go of chunks with nothing left to happen: every event pumps, so walking the chunks
        already done made a request of many chunks (layer-wise, long chunked prefills)
        quadratic on the control thread. Once the decode rank's next half is taken, the
        chunks queued behind it for one are passed over at the cost of a check."""
        if dst.down.lost:  # nothing more to a lost rank: this request is about to fail too
            return  # (losing a paused rank fails its requests in turn; one's staging given
            # back wakes another's waiting chunk here, before that one's turn came)
        taken = False  # halves are only taken here (given back by Unpacked): it stays so
        for chunk in list(dst.staged.values()):
            out = chunk.out
            if taken and out.needs_half:
                continue
            while (
                rec.error is None
                and out.next < out.rounds
                and (chunk.slice or not chunk.need)
                and not out.blocked
            ):
                began, was, packing = self.s.clock(), out.next, out.packing
                try:
                    ready = out.ready()  # expands the next round's copies
                except Exception as exc:  # the copier failed: nothing of the round was sent
                    self._fail(rec, "transfer", f"packing a staged round: {exc}")
                    return
                if out.next != was or out.packing is not packing:  # planned, not a pack awaited
                    rec.timeline.add("plan", began, self.s.clock())
                for span in out.packed:
                    rec.timeline.add("pack", *span)
                out.packed.clear()
                if ready is None:
                    break
                k, h, copies = ready
                layers = None if chunk.layers is None else sorted(chunk.layers)
                r = wire.Round(chunk=chunk.index, index=k, at=chunk.at, half=h, layers=layers)
                self._post(rec, dst, _sealed(copies, dst), r)
            if out.complete == out.rounds and chunk.slice:
                self._give(chunk)  # every round left it: another chunk may pack
            if out.finished and not chunk.slice:
                dst.staged.pop(chunk.index, None)  # written, unpacked, its staging given back
            taken = taken or (out.needs_half and not dst.halves.free)

    def written(self, rec: SendRec, dst: Dst, r: wire.Round) -> None:
        chunk = dst.staged.get(r.chunk)
        if chunk is not None:
            chunk.out.written(r.index)
            self.pump(rec, dst)

    def unpacked(self, rec: SendRec, dst: Dst, msg: wire.Unpacked) -> bool:
        chunk = dst.staged.get(msg.chunk) if dst.gen == msg.gen else None
        if chunk is None:
            return False
        chunk.out.unpacked(msg.index)
        self.pump(rec, dst)
        return True

    def release(self, rec: SendRec) -> None:
        """Give back every slice ``rec`` holds: its writes ended (done, or drained after abort),
        and so did any pack in flight (it reads the source, writes the slice)."""
        for dst in rec.dsts.values():
            for chunk in dst.staged.values():
                chunk.out.settle()
                if chunk.need and not chunk.slice:  # it waited until the request ended
                    rec.staging_wait_s += self._clock() - chunk.waiting_since
                self._give(chunk)

    @staticmethod
    def unfinished(dst: Dst) -> bool:
        """Some staged round of ``dst`` is not written yet (or not yet posted)."""
        return any(c.out.complete < c.out.rounds for c in dst.staged.values())

    @staticmethod
    def unposted(dst: Dst) -> bool:
        return any(c.out.next < c.out.rounds for c in dst.staged.values())
