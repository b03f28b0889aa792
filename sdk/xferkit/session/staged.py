"""The prefill side of staged chunks: pack rounds, post them as halves free up, count them.

A chunk goes staged when its pair's routes stage some pool it names and the
staging it needs is there: a slice of this rank's staging when it packs, the
slice the decode rank offered in its ``Request`` when it unpacks. Otherwise
it goes direct (slower, never wrong). Each round is one write whose tag names
its chunk and round; the decode rank unpacks it on arrival and answers
``Unpacked``, which frees that half of its slice for round k+2. Packs run on
one worker thread, so that round k+1 packs while round k is posted (NIXL
moves the bytes inside its post call on host memory); a finished pack wakes
the I/O thread with a ``pump`` command.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError
from . import wire
from .core import Core, log
from .handshake import Down
from .rounds import Outbound, Runner

if TYPE_CHECKING:
    from .prefill import Dst, SendRec


def dst_of(rec: SendRec, down: Down) -> Dst | None:
    """``down``'s part of ``rec`` (a request has one per decode rank and stage)."""
    return next((d for d in rec.dsts.values() if d.down is down), None)


class Chunk:
    """One staged chunk to one decode rank: its rounds and the slice they pack into."""

    __slots__ = ("at", "index", "out", "slice")

    def __init__(self, index: int, out: Outbound, slice_: int, at: dict) -> None:
        self.index, self.out, self.slice, self.at = index, out, slice_, at


class StagedWrites(Core):
    """Staged chunks of the Sends: planning, posting rounds, credits, giving staging back."""

    _packer: ThreadPoolExecutor | None = None  # started by the first chunk that packs

    def _runner(self, rid: str) -> Runner:
        """Packs ``rid``'s rounds on the pack worker; each one done pumps the request."""
        if self._packer is None:
            self._packer = ThreadPoolExecutor(1, thread_name_prefix="xferkit-pack")
        pool, copier = self._packer, self._copier

        def run(d: Descriptors) -> Future[None]:
            future = pool.submit(copier.copy, d.src, d.dst, d.nbytes)
            future.add_done_callback(lambda _: self._submit(("pump", rid)))
            return future

        return run

    def _on_pump(self, rid: str) -> None:
        """(I/O thread) a pack of ``rid`` finished: post what is ready."""
        rec = self._sends.get(rid)
        if rec is None or rec.error is not None:
            return
        for dst in list(rec.dsts.values()):
            self._pump(rec, dst)
        self._check_send(rec)

    def _stage_chunk(
        self,
        rec: SendRec,
        dst: Dst,
        request: Mapping[str, tuple[np.ndarray, np.ndarray]],
        at: dict[str, tuple[int, int, int]],
    ) -> tuple[Descriptors, Chunk] | None:
        """The chunk's direct part and its staged rounds, or None when it goes direct."""
        staged = dst.down.staged
        if staged is None or not staged.staged:
            return None
        pools = list(request)
        packs, unpacks = staged.packs(pools), staged.unpacks(pools)
        if not (packs or unpacks) or (unpacks and not dst.staging):
            return None
        slice_ = self._slices.take() if packs else 0
        if packs and slice_ is None:
            return None  # every slice is out: direct, and slower
        try:
            req = staged.expand(
                request, src_capacity=self._slices.half, dst_capacity=dst.staging_bytes // 2
            )
        except PlanError as exc:
            if slice_:
                self._slices.give(slice_)
            log.warning("%s: staging request %r: %s; going direct", self.address, rec.rid, exc)
            return None
        out = Outbound(
            req,
            slice_ or 0,
            dst.staging,
            self._slices.half,
            dst.staging_bytes // 2,
            dst.halves,
            self._copier,
            self._runner(rec.rid) if packs else None,
        )
        chunk = Chunk(dst.chunks, out, slice_ or 0, at)
        dst.chunks += 1
        dst.staged[chunk.index] = chunk
        return req.direct, chunk

    def _pump(self, rec: SendRec, dst: Dst) -> None:
        """Post every round whose halves are free, oldest chunk first (they share the decode
        rank's halves); give back the slices of chunks whose writes all completed."""
        for chunk in list(dst.staged.values()):
            while rec.error is None:
                try:
                    ready = chunk.out.ready()
                except Exception as exc:  # the copier failed: nothing of the round was sent
                    self._fail_send(rec, "transfer", f"packing a staged round: {exc}")
                    return
                if ready is None:
                    break
                k, h, wire_copies = ready
                r = wire.Round(chunk=chunk.index, index=k, at=chunk.at, half=h)
                self._post(rec, dst, wire_copies, r)
            if chunk.out.complete == chunk.out.rounds and chunk.slice:
                self._slices.give(chunk.slice)  # every round left it: another chunk may pack
                chunk.slice = 0

    def _round_written(self, rec: SendRec, dst: Dst, r: wire.Round) -> None:
        chunk = dst.staged.get(r.chunk)
        if chunk is not None:
            chunk.out.written(r.index)
            self._pump(rec, dst)

    def _on_unpacked(self, down: Down, msg: wire.Unpacked) -> None:
        rec = self._sends.get(msg.rid)
        dst = None if rec is None else dst_of(rec, down)
        chunk = None if dst is None or dst.gen != msg.gen else dst.staged.get(msg.chunk)
        if rec is None or dst is None or chunk is None:
            log.info(
                "%s: Unpacked for %r, which is not staging here: dropped", self.address, msg.rid
            )
            return
        chunk.out.unpacked(msg.index)
        self._pump(rec, dst)
        self._check_send(rec)

    def _release_staging(self, rec: SendRec) -> None:
        """Give back every slice ``rec`` holds: its writes ended (done, or drained after abort),
        and so did any pack in flight (it reads the source, writes the slice)."""
        for dst in rec.dsts.values():
            for chunk in dst.staged.values():
                chunk.out.settle()
                if chunk.slice:
                    self._slices.give(chunk.slice)
                    chunk.slice = 0

    if TYPE_CHECKING:  # the prefill side's

        def _post(
            self, rec: SendRec, dst: Dst, descs: Descriptors, r: wire.Round | None
        ) -> None: ...
        def _check_send(self, rec: SendRec) -> None: ...
        def _fail_send(self, rec: SendRec, stage: str, detail: str) -> None: ...
        def _submit(self, command: tuple[Any, ...]) -> None: ...
