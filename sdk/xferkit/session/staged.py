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
round k is posted; a finished pack comes back as ``Protocol.pump``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError
from ..planner.expand import Layers
from . import wire
from .core import Settings, log
from .rounds import Outbound, Runner, aligned
from .sends import Chunk, Dst, SendRec

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
    ) -> tuple[Descriptors, Chunk] | None:
        """The chunk's direct part and its staged rounds, or None when it goes direct."""
        staged = dst.down.staged
        if staged is None or not staged.staged or self.s.copier is None:
            return None
        pools = list(request)
        packs, unpacks = staged.packs(pools), staged.unpacks(pools)
        if not (packs or unpacks) or (unpacks and not dst.staging):
            return None
        arena = self.s.arena
        try:
            req = staged.expand(
                request, src_capacity=arena.half, dst_capacity=dst.staging_bytes // 2,
                layers=layers,
            )  # fmt: skip
        except PlanError as exc:
            log.warning("%s: staging request %r: %s; going direct", self.s.address, rec.rid, exc)
            return None
        # Two halves where rounds alternate, one where a single round holds the chunk.
        half = min(aligned(req.src_bytes), arena.half) if packs else 0
        need = half * min(len(req.rounds), 2)  # within the slice: a piece always comes
        out = Outbound(
            req,
            0,
            dst.staging,
            half,
            dst.staging_bytes // 2,
            dst.halves,
            self.s.copier,
            self._runner(rec.rid) if packs else None,
        )
        chunk = Chunk(dst.chunks, out, need, at, layers)
        dst.chunks += 1
        dst.staged[chunk.index] = chunk
        if need:
            chunk.waiting_since = self._clock()
            self._waiting.append((rec, dst, chunk))
            for r, d in self._serve():
                if d is not dst:  # the caller pumps this one
                    self.pump(r, d)
        return req.direct, chunk

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
                k, h, wire_copies = ready
                layers = None if chunk.layers is None else sorted(chunk.layers)
                r = wire.Round(chunk=chunk.index, index=k, at=chunk.at, half=h, layers=layers)
                self._post(rec, dst, wire_copies, r)
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
