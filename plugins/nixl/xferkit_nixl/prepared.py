"""Prepared descriptor lists: every slot of every region as one entry, and the lookup onto them.

``make_prepped_xfer`` moves whole entries of lists prepared beforehand, paired
by index. One entry per region would not do (a request moves a few slots of a
region, not all of it), so the entries are the regions' slots, the unit a
request allocates: a descriptor that starts on a slot boundary on both sides
and covers k whole slots of equal size becomes k index pairs (NIXL merges
entries that turn out contiguous). Anything else (a piece within a slot, as a
heterogeneous-TP head slice is) does not match, and the caller falls back to
``initialize_xfer``.
"""

from __future__ import annotations

import numpy as np

from xferkit import Descriptors, Manifest

MAX_ENTRIES = 1 << 20
"""Most entries per side: beyond this the prepared lists cost more memory than they save."""

MAX_EXPANSION = 64
"""Most entries per descriptor, on average (tiny slots would turn one copy into thousands)."""


class SlotTable:
    """One side's regions, sorted by address, each cut into its slots."""

    __slots__ = ("counts", "devid", "entries", "first", "slot", "starts")

    def __init__(self, manifest: Manifest, devid: int) -> None:
        order = np.argsort(manifest.addrs, kind="stable")
        self.starts = manifest.addrs[order]
        self.slot = manifest.item_nbytes[order]
        self.counts = manifest.slots[order].astype(np.int64)
        self.first = np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64)
        self.entries = int(self.counts.sum())
        self.devid = devid

    def rows(self) -> np.ndarray:
        """The entries as NIXL's Nx3 (address, length, device id) array."""
        region = np.repeat(np.arange(self.counts.size), self.counts)
        within = (np.arange(self.entries, dtype=np.int64) - self.first[region]).astype(np.uint64)
        slot = self.slot[region]
        out = np.empty((self.entries, 3), dtype=np.uint64)
        out[:, 0] = self.starts[region] + within * slot
        out[:, 1] = slot
        out[:, 2] = self.devid
        return out

    def _locate(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(region, offset in it, slot size) of addresses the core proved lie in a region."""
        region = np.searchsorted(self.starts, addrs, side="right") - 1
        return region, addrs - self.starts[region], self.slot[region]


def indices(
    local: SlotTable, remote: SlotTable, d: Descriptors
) -> tuple[np.ndarray, np.ndarray] | None:
    """Entry indices (local, remote) moving ``d`` exactly, or None when ``d`` is not whole slots."""
    lr, loff, lslot = local._locate(d.src)
    rr, roff, rslot = remote._locate(d.dst)
    if not (lslot == rslot).all():
        return None
    if (loff % lslot).any() or (roff % rslot).any() or (d.nbytes % lslot).any():
        return None
    li = local.first[lr] + (loff // lslot).astype(np.int64)
    ri = remote.first[rr] + (roff // rslot).astype(np.int64)
    k = (d.nbytes // lslot).astype(np.int64)
    total = int(k.sum())
    if total == k.size:
        return li.astype(np.int32), ri.astype(np.int32)
    if total > MAX_EXPANSION * k.size:
        return None
    step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
    return (np.repeat(li, k) + step).astype(np.int32), (np.repeat(ri, k) + step).astype(np.int32)
