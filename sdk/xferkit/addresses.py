"""Disjoint address ranges looked up vectorized: the one interval lookup.

The core's bounds checks, ``Manifest.locate``, drivers that need a
descriptor's region and the test checkers all use it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_ONE = np.uint64(1)


class AddressTable:
    """Disjoint address ranges, sorted once, looked up vectorized in O(n log ranges).

    Ends are kept inclusive (the last byte), so a range ending at 2**64 never wraps.
    """

    __slots__ = ("last", "order", "starts")

    def __init__(self, addrs: npt.ArrayLike, nbytes: npt.ArrayLike) -> None:
        addrs = np.asarray(addrs, dtype=np.uint64)
        self.order = np.argsort(addrs, kind="stable")
        self.starts = addrs[self.order]
        self.last = self.starts + (np.asarray(nbytes, dtype=np.uint64)[self.order] - np.uint64(1))

    def __len__(self) -> int:
        return int(self.starts.size)

    def _inside(
        self, addrs: np.ndarray, nbytes: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(position in the sorted table, mask of ranges held whole by that entry).

        A position of -1 (below every range) indexes the last entry: harmless, masked.
        """
        addrs = np.asarray(addrs, dtype=np.uint64)
        where = self.starts.searchsorted(addrs, side="right")
        where -= 1
        # A zero-length range would wrap below its start: it lies in none.
        end = addrs if nbytes is None else addrs + (np.asarray(nbytes, dtype=np.uint64) - _ONE)
        inside = end <= self.last[where]
        inside &= end >= addrs
        inside &= where >= 0
        return where, inside

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray | None = None) -> np.ndarray:
        """Index (into the ranges as given) of the range holding each ``[addr, addr+nbytes)``.

        -1 where none holds it whole, including a range that wraps past 2**64.
        """
        if not self.starts.size:
            return np.full(np.shape(addrs), -1, dtype=np.int64)
        where, inside = self._inside(addrs, nbytes)
        out = self.order[where]
        out[~inside] = -1
        return out

    def first_outside(self, addrs: np.ndarray, nbytes: np.ndarray | None = None) -> int:
        """Index of the first ``[addr, addr+nbytes)`` that no range holds whole, or -1."""
        if not np.size(addrs):
            return -1
        if not self.starts.size:
            return 0
        _, inside = self._inside(addrs, nbytes)
        return -1 if inside.all() else int(np.argmin(inside))

    def nearest(self, addr: int) -> int:
        """Index of the range starting at or below ``addr`` (else the lowest); -1 when empty."""
        if not self.starts.size:
            return -1
        i = int(np.searchsorted(self.starts, np.uint64(addr), side="right")) - 1
        return int(self.order[max(i, 0)])

    def first_overlap(self) -> tuple[int, int] | None:
        """Indices of two ranges that overlap, or None."""
        clash = np.flatnonzero(self.last[:-1] >= self.starts[1:])
        if not clash.size:
            return None
        return int(self.order[clash[0]]), int(self.order[clash[0] + 1])
