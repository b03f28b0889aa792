"""A rank's memory as the checker sees it: whose use each slot is offered to, right now.

The bytes are the reference model's (real arrays, real addresses: the simulated driver
copies them) and a staging buffer after them, as a Session registers one; beside them, per
pool, the use each slot is offered to (0: none), set when the rank's engine calls
``expect`` or ``offer`` and cleared when its handle is terminal, and the staging slices each
claim's ``Request`` offered a source. A write is checked against these at the moment it
lands (invariant 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...session.rounds import Staging
from ..reference import Rank

if TYPE_CHECKING:
    from .engine import Handle, Use

UNWRITTEN = 0xA5
"""What a destination slot holds between its allocation and the first write of its request."""


_STAGINGS: dict[tuple[int, int, int], Staging] = {}


def _staging(rank: Rank, nbytes: int, copy: int) -> Staging:
    """One staging buffer (and manifest) per reference rank and size, reused by every schedule:
    building its manifest was a tenth of a short schedule (the reference ranks live as long)."""
    key = (id(rank), nbytes, copy)
    if key not in _STAGINGS:
        _STAGINGS[key] = Staging(rank.manifest, nbytes)
    return _STAGINGS[key]


class Memory:
    def __init__(self, rank: Rank, side: str, staging_bytes: int, copy: int = 0) -> None:
        """``copy``: which instance's rank (instances share the reference's bytes, each has
        a staging buffer of its own)."""
        self.arrays, self.side, self.stage = rank.arrays, side, rank.pp_stage
        self.staging = _staging(rank, staging_bytes, copy)  # the Session's, after the regions
        self.staging.buffer[:] = 0  # a schedule starts from a scrubbed buffer, as it replays
        self.manifest = self.staging.manifest
        base = int(self.staging.buffer.ctypes.data) if staging_bytes else 0
        self.staged_at = (base, base + staging_bytes)
        self.offers: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (rid, gen) -> slices
        m = self.regions = rank.manifest  # the engine's
        self.pools = sorted(m.pools)
        self.region_addr = m.addrs.astype(np.int64)
        self.region_slot = np.array([r.slot_nbytes for r in m], dtype=np.int64)
        self.region_pool = np.array([self.pools.index(r.pool) for r in m], dtype=np.int64)
        self.owner = [np.zeros(m.pools[p], dtype=np.int64) for p in self.pools]
        self.serials: dict[tuple[str, int], int] = {}  # (rid, claim generation) -> use

    def clear(self) -> None:
        for o in self.owner:
            o[:] = 0
        self.serials.clear()
        self.offers.clear()

    def offer_staging(self, rid: str, gen: int, start: int, nbytes: int) -> None:
        """A decode rank's Request offered a source ``[start, +nbytes)`` of its staging: from
        now on that slice is this claim's alone (whoever held it before lost it)."""
        end = start + nbytes
        for ranges in self.offers.values():
            ranges[:] = [(a, b) for a, b in ranges if b <= start or a >= end]
        self.offers.setdefault((rid, gen), []).append((start, end))

    def scrub(self, slots: dict[str, list[int]]) -> None:
        for key, array in self.arrays.items():
            if key[0] in slots:
                array[slots[key[0]]] = UNWRITTEN

    def _slots(self, use: Use) -> dict[str, list[int]]:
        return use.dst if self.side == "dst" else use.src

    def offered(self, use: Use) -> None:
        for pool, got in self._slots(use).items():
            self.owner[self.pools.index(pool)][got] = use.serial

    def released(self, h: Handle) -> None:
        serial = h.use.serial
        for pool, got in self._slots(h.use).items():
            o = self.owner[self.pools.index(pool)]
            o[got] = np.where(o[got] == serial, 0, o[got])
        for key in [k for k, v in self.serials.items() if v == serial]:
            del self.serials[key]
            self.offers.pop(key, None)

    def foreign_staging(
        self, addrs: np.ndarray, nbytes: np.ndarray, key: tuple[str, int]
    ) -> str | None:
        """Where a write of claim ``key`` lands in staging outside the slices it was offered."""
        ranges = self.offers.get(key, [])
        end = addrs + nbytes
        inside = np.zeros(addrs.size, dtype=bool)
        for a, b in ranges:
            inside |= (addrs >= a) & (end <= b)
        if inside.all():
            return None
        i = int(np.flatnonzero(~inside)[0])
        at = int(addrs[i]) - self.staged_at[0]
        return f"staging at +{at} (+{int(nbytes[i])}), not offered to it"

    def in_staging(self, addrs: np.ndarray) -> np.ndarray:
        lo, hi = self.staged_at
        return (addrs >= lo) & (addrs < hi)

    def foreign(self, addrs: np.ndarray, nbytes: np.ndarray, serial: int) -> str | None:
        """Where bytes ``[addrs, +nbytes)`` touch a slot not held by use ``serial``, or None."""
        where = self.regions.locate(addrs, nbytes)
        if (where < 0).any():
            i = int(np.flatnonzero(where < 0)[0])
            return f"{int(addrs[i]):#x} (+{int(nbytes[i])}) outside every region"
        off = addrs.astype(np.int64) - self.region_addr[where]
        size = self.region_slot[where]
        first, last = off // size, (off + nbytes.astype(np.int64) - 1) // size
        pool = self.region_pool[where]
        for p, owner in enumerate(self.owner):
            mine = pool == p
            if not mine.any():
                continue
            lo, span = first[mine], last[mine] - first[mine] + 1  # every slot each touches
            slots = (
                np.repeat(lo, span)
                + np.arange(span.sum())
                - np.repeat(np.cumsum(span) - span, span)
            )
            held = owner[slots]
            bad = np.flatnonzero(held != serial)
            if bad.size:
                return (
                    f"{self.pools[p]} slot {int(slots[bad[0]])} (held by use {int(held[bad[0]])})"
                )
        return None
