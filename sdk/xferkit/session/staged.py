"""The prefill side of staged chunks: pack rounds, post them as halves free up, count them.

A chunk goes staged when its pair's routes stage some pool it names and the
staging it needs is there: a slice of this rank's staging when it packs, the
slice the decode rank offered in its ``Request`` when it unpacks. Otherwise
it goes direct (slower, never wrong). Each round is one write whose tag names
its chunk and round; the decode rank unpacks it on arrival and answers
``Unpacked``, which frees that half of its slice for round k+2. Packs run off
the control thread (``Settings.runner``), so that round k+1 packs while round
k is posted; a finished pack comes back as ``Protocol.pump``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError
from . import wire
from .core import Settings, log
from .rounds import Outbound, Runner
from .sends import Chunk, Dst, SendRec

PostRound = Callable[[SendRec, Dst, Descriptors, wire.Round], None]
FailSend = Callable[[SendRec, str, str], None]


class Stager:
    """Staged chunks of the Sends: planning, posting rounds, credits, giving staging back."""

    def __init__(self, s: Settings, post: PostRound, fail: FailSend) -> None:
        self.s, self._post, self._fail = s, post, fail

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
    ) -> tuple[Descriptors, Chunk] | None:
        """The chunk's direct part and its staged rounds, or None when it goes direct."""
        staged = dst.down.staged
        if staged is None or not staged.staged or self.s.copier is None:
            return None
        pools = list(request)
        packs, unpacks = staged.packs(pools), staged.unpacks(pools)
        if not (packs or unpacks) or (unpacks and not dst.staging):
            return None
        slices = self.s.slices
        slice_ = slices.take() if packs else 0
        if packs and slice_ is None:
            return None  # every slice is out: direct, and slower
        try:
            req = staged.expand(
                request, src_capacity=slices.half, dst_capacity=dst.staging_bytes // 2
            )
        except PlanError as exc:
            if slice_:
                slices.give(slice_)
            log.warning("%s: staging request %r: %s; going direct", self.s.address, rec.rid, exc)
            return None
        out = Outbound(
            req,
            slice_ or 0,
            dst.staging,
            slices.half,
            dst.staging_bytes // 2,
            dst.halves,
            self.s.copier,
            self._runner(rec.rid) if packs else None,
        )
        chunk = Chunk(dst.chunks, out, slice_ or 0, at)
        dst.chunks += 1
        dst.staged[chunk.index] = chunk
        return req.direct, chunk

    def pump(self, rec: SendRec, dst: Dst) -> None:
        """Post every round whose halves are free, oldest chunk first (they share the decode
        rank's halves); give back the slices of chunks whose writes all completed."""
        for chunk in list(dst.staged.values()):
            while rec.error is None:
                try:
                    ready = chunk.out.ready()
                except Exception as exc:  # the copier failed: nothing of the round was sent
                    self._fail(rec, "transfer", f"packing a staged round: {exc}")
                    return
                if ready is None:
                    break
                k, h, wire_copies = ready
                r = wire.Round(chunk=chunk.index, index=k, at=chunk.at, half=h)
                self._post(rec, dst, wire_copies, r)
            if chunk.out.complete == chunk.out.rounds and chunk.slice:
                self.s.slices.give(chunk.slice)  # every round left it: another chunk may pack
                chunk.slice = 0

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
                if chunk.slice:
                    self.s.slices.give(chunk.slice)
                    chunk.slice = 0

    @staticmethod
    def unfinished(dst: Dst) -> bool:
        """Some staged round of ``dst`` is not written yet (or not yet posted)."""
        return any(c.out.complete < c.out.rounds for c in dst.staged.values())

    @staticmethod
    def unposted(dst: Dst) -> bool:
        return any(c.out.next < c.out.rounds for c in dst.staged.values())
