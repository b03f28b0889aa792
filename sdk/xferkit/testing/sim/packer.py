"""The Session's pack worker, simulated: staged rounds packed off the core's call.

A Session packs each staged round into its staging on one worker thread
(``session.packer``): the core starts the copy and goes on, and the copy's end comes
back as ``Protocol.pump``. Here (``Config.packer``) each pack ends after a delay drawn
from the seed, one at a time per rank and in order (one thread runs them), later if
its process is stopped, never if it is killed; it copies its bytes then, and checks
what it read: the source slots must still be offered to that request (invariant 1: no
source byte is read after its request is terminal there). A core that waits for a pack
in flight (``Outbound.settle``: its control thread blocks until the copy ended) has it
end at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...copier import CPU
from ...descriptors import Descriptors

if TYPE_CHECKING:
    from .world import Rank, World


class Pack:
    """One pack copy in flight: ``session.rounds.Pending``."""

    def __init__(self, packs: Packs, rank: Rank, rid: str, descs: Descriptors) -> None:
        self.packs, self.rank, self.rid, self.descs = packs, rank, rid, descs
        self.incarnation = rank.incarnation
        self.began = self.ended_at = rank.local(packs.w.now)
        self.ended = False

    def done(self) -> bool:
        return self.ended

    def result(self) -> tuple[float, float]:
        if not self.ended:  # the control thread waited for the worker to finish it
            self.packs.finish(self)
        return self.began, self.ended_at


class Packs:
    """Every rank's pack worker."""

    def __init__(self, world: World) -> None:
        self.w = world
        self._free_at: dict[str, float] = {}  # rank -> when its worker is free again

    def run(self, rank: Rank, rid: str, descs: Descriptors) -> Pack:
        """``Settings.runner``: start a pack of ``rid``'s on ``rank``'s worker."""
        w = self.w
        pack = Pack(self, rank, rid, descs)
        busy = w.rng.random() < 0.1  # a worker the GIL or the machine holds back
        delay = w.rng.uniform(2e-3, 0.05) if busy else w.rng.uniform(1e-5, 2e-3)
        due = max(w.now, self._free_at.get(rank.name, 0.0)) + delay
        self._free_at[rank.name] = due
        w.at(due, self._due, pack)
        return pack

    def _due(self, pack: Pack) -> None:
        rank, w = pack.rank, self.w
        if rank.incarnation != pack.incarnation or not rank.alive:
            return  # the process (and its worker) is gone
        if rank.paused_until > w.now:
            w.at(w.resumed(rank), self._due, pack)
            return
        if not pack.ended:
            self.finish(pack)
        w.to(rank, w.now, "pump", pack.rid)  # the future's callback wakes the control thread

    def finish(self, pack: Pack) -> None:
        rank, w, d = pack.rank, self.w, pack.descs
        serial = next(
            (h.use.serial for h in rank.handles
             if h.request_id == pack.rid and h.side == "prefill" and not h.terminal),
            -1,
        )  # fmt: skip
        read = ~rank.memory.in_staging(d.src)
        bad = rank.memory.foreign(d.src[read], d.nbytes[read], serial)
        if bad is not None:
            w.check.violate(1, f"a pack of {pack.rid!r} on {rank.name} read its {bad}")
        lo, hi = rank.memory.staged_at
        out = np.flatnonzero((d.dst < lo) | (d.dst + d.nbytes > hi))
        if out.size:
            at, n = int(d.dst[out[0]]) - lo, int(d.nbytes[out[0]])
            w.check.violate(1, f"a pack of {pack.rid!r} on {rank.name} wrote outside its "
                            f"staging: at +{at} (+{n}), staging {hi - lo} bytes")  # fmt: skip
        if bad is None and not out.size:  # a bad copy is reported, never made: it could crash
            CPU.copy(d.src, d.dst, d.nbytes)
        pack.ended, pack.ended_at = True, rank.local(w.now)
