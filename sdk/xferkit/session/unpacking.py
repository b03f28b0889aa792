"""The decode side of staged chunks: the staging each source may write rounds into, and
unpacking the rounds that land there.

A decode request offers each source whose routes unpack a piece of this rank's
staging sized to the request (two halves, each able to hold the whole of it, at
most a slice), named in its ``Request``; a request that finds the staging full
waits for it (``Incoming`` queues it) rather than have its sources write the
slower way. Rounds are cut as the prefill rank cut them, from the chunk's span
and both sides' capacities; a round is unpacked once, into the request's slots
and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import PlanError
from ..staging import StagedPlan
from . import wire
from .core import Settings
from .pairs import Up
from .rounds import ALIGN, Inbound, aligned


class Source:
    """What a decode request still needs from one source rank, and the piece of staging it
    may write rounds into (``slice``: its start, 0 for none; ``offer``: its size)."""

    __slots__ = ("claimed", "inbound", "offer", "rank", "seen", "slice", "total")

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.total = rank, 0, 0
        self.slice = self.offer = 0
        self.inbound: dict[int, Inbound] = {}  # staged chunk -> its rounds, unpacked as they land
        # pool -> (layer -> row, [row, slot]): the request's slots a chunk named, per layer
        # (a layer-wise chunk names its layers'); one array, so a chunk of an 80-layer pool
        # checks and marks its span in two numpy calls, not 240 (193 -> 4 us a chunk)
        self.claimed: dict[str, tuple[dict[int, int], np.ndarray]] = {}

    @property
    def complete(self) -> bool:
        return self.total > 0 and self.seen >= self.total


class Unpacker:
    """Staging offered to sources, and the rounds unpacked from it."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        # Bytes of one slot of each pool here: the most unpacking a slot of it needs.
        self._slot_bytes: dict[str, int] = {}
        for r in s.manifest.regions:
            self._slot_bytes[r.pool] = self._slot_bytes.get(r.pool, 0) + r.slot_nbytes

    def offer(self, staged: StagedPlan, slots: Mapping[str, np.ndarray]) -> int:
        """Bytes of staging to offer a source for a request naming ``slots`` (0: none)."""
        need = sum(
            self._slot_bytes.get(p, 0) * s.size for p, s in slots.items() if staged.unpacks((p,))
        )
        return min(2 * aligned(need), self.s.arena.slice_bytes) if need else 0

    def fit(self, sources: Iterable[Source]) -> None:
        """Shrink the sources' offers so that a request's pieces fit the staging together:
        otherwise, with nothing else in flight, it would wait for them until its deadline
        (TP 4 -> 1 on a small arena did). A smaller piece means more rounds; one too small
        for a slot of a region makes its source go direct."""
        offering = [src for src in sources if src.offer]
        if offering and sum(src.offer for src in offering) > self.s.arena.size:
            share = self.s.arena.size // len(offering) // (2 * ALIGN) * (2 * ALIGN)
            for src in offering:
                src.offer = min(src.offer, share)

    def take(self, sources: Iterable[Source]) -> bool:
        """A piece for every source offered one, or none of them (given back) and False."""
        sources = list(sources)
        for src in sources:
            if src.offer and not src.slice:
                start = self.s.arena.take(src.offer)
                if start is None:
                    self.give(sources)
                    return False
                src.slice = start
        return True

    def give(self, sources: Iterable[Source]) -> bool:
        """Give back the sources' staging; whether any was held."""
        given = False
        for src in sources:
            if src.slice:
                self.s.arena.give(src.slice)
                src.slice = 0
                src.inbound.clear()
                given = True
        return given

    def landed(
        self, slots: Mapping[str, np.ndarray], up: Up, src: Source, r: wire.Round
    ) -> tuple[str, bool]:
        """Unpack a staged round that landed in ``src``'s staging into ``slots``: what is wrong
        with it (nothing was unpacked then), and whether a half of the staging is free again."""
        inbound = src.inbound.get(r.chunk)
        if inbound is None:
            try:
                inbound = src.inbound[r.chunk] = self._inbound(slots, up, src, r)
            except (PlanError, KeyError) as exc:
                return f"a staged chunk naming {exc}", False
        if not 0 <= r.index < len(inbound.req.rounds):
            return f"round {r.index} of a chunk of {len(inbound.req.rounds)}", False
        if not inbound.req.rounds[r.index].dst_bytes:
            return "", False
        if not src.slice or not inbound.landed(r.index, r.half):
            return f"round {r.index} landing twice or in staging never offered", False
        return "", True

    def _inbound(
        self, slots: Mapping[str, np.ndarray], up: Up, src: Source, r: wire.Round
    ) -> Inbound:
        """The rounds of a new staged chunk, cut as the prefill rank cut them; ``PlanError``
        for one naming slots outside the request, or slots another chunk named (a prefill's
        chunks move forward: an overlap is forged, and would unpack twice)."""
        if up.staged is None or up.welcome is None or self.s.copier is None:
            raise PlanError("a round from a pair without staging")
        chunk = {}
        plan, layers = up.staged.plan, None if r.layers is None else frozenset(r.layers)
        for pool, (first, count, sources) in r.at.items():
            dst = slots[pool][first : first + count]
            claimed = src.claimed.get(pool)
            if claimed is None:
                order = sorted(plan.layers(pool))
                held = np.zeros((len(order), slots[pool].size), bool)
                claimed = src.claimed[pool] = ({layer: i for i, layer in enumerate(order)}, held)
            row, held = claimed
            rows = slice(None) if layers is None else [row[x] for x in layers if x in row]
            pages = plan.pages(pool) or (1, 1)
            if (
                dst.size != count
                or sources > count * pages[1]
                or held[rows, first : first + count].any()
            ):
                raise PlanError(f"slots [{first}, +{count}) of pool {pool!r} from {sources}")
            held[rows, first : first + count] = True
            # Only how many: the sources' slots are the prefill rank's to know.
            chunk[pool] = (np.zeros(sources, dtype=np.int64), dst)
        half = src.offer // 2 if src.slice else 0
        req = up.staged.expand(
            chunk,
            src_capacity=up.welcome.slice_bytes // 2,
            dst_capacity=half,
            direct=False,
            layers=layers,
        )
        return Inbound(req, src.slice, half, self.s.copier)
