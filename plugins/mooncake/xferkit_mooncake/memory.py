"""Which engine registrations hold which regions: touching regions share one.

Mooncake's cost per registration call grows with the number of buffers the
engine already holds (measured: 16,000 buffers take 3.7 s to register, 4x the
time of 8,000), so 100,000 regions took minutes. Engines carve their regions
from a few large allocations (layers, streams, parts side by side), so the
driver registers each run of touching regions as one engine buffer: the work
is a sort plus one engine call per run. Only exactly touching regions are
joined; memory between regions is never offered to peers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xferkit.driver import Region


class Runs:
    """Maximal runs of touching regions: ``starts``, ``lengths`` and each region's run start."""

    __slots__ = ("counts", "lengths", "of_region", "starts")

    def __init__(self, regions: Sequence[Region]) -> None:
        addrs = np.fromiter((r.addr for r in regions), np.uint64, len(regions))
        ends = addrs + np.fromiter((r.nbytes for r in regions), np.uint64, len(regions))
        order = np.argsort(addrs, kind="stable")
        a, e = addrs[order], ends[order]
        reach = np.maximum.accumulate(e)  # regions never overlap; this only keeps runs sound
        new = np.ones(len(a), bool)
        new[1:] = a[1:] > reach[:-1]
        first = np.flatnonzero(new)
        run = np.cumsum(new) - 1  # the run of each region, in address order
        self.starts: list[int] = a[first].tolist()
        ends_of_runs = np.maximum.reduceat(e, first) if len(a) else e
        self.lengths: list[int] = (ends_of_runs - a[first]).tolist()
        self.counts: list[int] = np.bincount(run, minlength=len(first)).tolist()
        of = np.empty(len(a), np.uint64)
        of[order] = a[first][run]
        self.of_region: list[int] = of.tolist()


class Holdings:
    """Engine buffers this driver registered, and the regions each one holds.

    A buffer is unregistered from the engine when its last region is: the core
    deregisters a whole manifest, so by the end of ``deregister`` nothing is left.
    """

    def __init__(self) -> None:
        self._run_of: dict[int, int] = {}  # region address -> start of its engine buffer
        self._refs: dict[int, int] = {}  # buffer start -> regions in it, in registration order
        self._lengths: dict[int, int] = {}  # buffer start -> its length

    def add(self, runs: Runs, regions: Sequence[Region]) -> None:
        self._refs.update(zip(runs.starts, runs.counts, strict=True))
        self._lengths.update(zip(runs.starts, runs.lengths, strict=True))
        self._run_of.update(zip((r.addr for r in regions), runs.of_region, strict=True))

    def add_one(self, region: Region) -> None:
        self._refs[region.addr] = 1
        self._lengths[region.addr] = region.nbytes
        self._run_of[region.addr] = region.addr

    def remove(self, region: Region) -> int | None:
        """The engine buffer to unregister now (its last region left), else None."""
        start = self._run_of.pop(region.addr, None)
        if start is None:
            return region.addr  # not ours: the engine says whether it holds it
        self._refs[start] -= 1
        if self._refs[start]:
            return None
        del self._refs[start]
        del self._lengths[start]
        return start

    def starts(self) -> list[int]:
        """Every engine buffer held now."""
        return list(self._refs)

    def lengths(self) -> list[int]:
        """Their lengths, in the order of ``starts``."""
        return [self._lengths[start] for start in self._refs]

    def clear(self) -> None:
        self._run_of.clear()
        self._refs.clear()
        self._lengths.clear()

    def anchor(self) -> int:
        """A registered address (the first buffer's start), 0 when none is."""
        return next(iter(self._refs), 0)

    def __len__(self) -> int:
        return len(self._refs)
