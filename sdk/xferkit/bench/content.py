"""Bytes anyone can recompute: the bench's model content, written on prefill, checked on decode.

Every element of a region's *global* tensor is a hash of (region, source slot,
element index), so a prefill rank fills only its own shard and a decode rank
computes what its requested pages must hold without either building the whole
model (the test suite's ``Reference`` does, which is fine at test sizes only).
The index arithmetic (sharding, layouts, page maps) is the reference model's
(``xferkit.testing.reference``), not the planner's, so a planner bug cannot
cancel itself out.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..manifest import key_label
from ..testing.reference import RegionSpec, Side, page_pairs, paged, shard, to_side

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)


def _salt(spec: RegionSpec) -> np.uint64:
    return np.uint64(zlib.crc32(key_label(spec.key).encode()) * 0x100000001)


def _elements(spec: RegionSpec, side: Side) -> int:
    """Elements in one global slot of ``side`` (its pages included)."""
    return math.prod(spec.side_shape(side))


def _hash(spec: RegionSpec, slots: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``[len(slots), *index.shape, itemsize]`` bytes: element ``index`` of global ``slots``."""
    x = slots.astype(np.uint64).reshape(-1, *([1] * index.ndim)) * np.uint64(_elements(spec, "src"))
    x = x + index.astype(np.uint64)
    x ^= _salt(spec)
    x *= _K1
    x ^= x >> np.uint64(31)
    x *= _K2
    x ^= x >> np.uint64(29)
    x *= _K3
    x ^= x >> np.uint64(32)
    return x.view(np.uint8).reshape(*x.shape, 8)[..., : spec.itemsize]


def _canonical_index(spec: RegionSpec) -> np.ndarray:
    """Element indices of one global source slot, ``[1, *side_shape("src"), 1]`` (canonical)."""
    shape = spec.side_shape("src")
    return np.arange(math.prod(shape), dtype=np.int64).reshape(1, *shape, 1)


def fill_source(spec: RegionSpec, array: np.ndarray, tp_rank: int, tp_size: int) -> None:
    """Write the model's bytes into a prefill rank's array (``[slots, ..., itemsize]``)."""
    if not array.size:
        return
    local = to_side(spec, "src", shard(spec, _canonical_index(spec), tp_rank, tp_size))[0, ..., 0]
    rows = max(1, (16 << 20) // max(1, local.size * 8))  # bound the uint64 temporaries
    for start in range(0, array.shape[0], rows):
        slots = np.arange(start, min(start + rows, array.shape[0]))
        array[slots] = _hash(spec, slots, local).reshape(array[slots].shape)


class Checker:
    """What a decode rank's requested pages must hold, per region (index maps cached)."""

    def __init__(self, specs: list[RegionSpec], tp_rank: int, tp_size: int) -> None:
        self.specs = specs
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._maps: dict[Any, np.ndarray] = {}

    def _page_map(self, spec: RegionSpec) -> np.ndarray:
        """``[src_pages, *local page dims]``: the global element index behind each element of
        one destination page, per source page it may come from."""
        found = self._maps.get(spec.key)
        if found is None:
            pages = paged(_canonical_index(spec), spec.token_axis, spec.src_pages)[0]
            found = np.stack(
                [
                    to_side(spec, "dst", shard(spec, p[None], self.tp_rank, self.tp_size))[
                        0, ..., 0
                    ]
                    for p in pages
                ]
            )
            self._maps[spec.key] = found
        return found

    def _cells(
        self, spec: RegionSpec, array: np.ndarray, dst: np.ndarray, pages: np.ndarray
    ) -> np.ndarray:
        t = spec.token_axis
        t_dst = None if t is None else spec.order("dst").index(t)
        return paged(array, t_dst, spec.dst_pages)[dst, pages]

    def check(
        self,
        arrays: Mapping[Any, np.ndarray],
        request: dict[str, tuple[list[int], list[int]]],
    ) -> None:
        """AssertionError naming the first region and slot whose bytes differ from the model."""
        for spec in self.specs:
            array = arrays.get(spec.key)
            if array is None or not array.size or spec.pool not in request:
                continue
            s_slot, s_page, d_slot, d_page = page_pairs(spec, *request[spec.pool])
            want = self._expected(spec, s_slot, s_page)
            got = self._cells(spec, array, d_slot, d_page).reshape(len(d_slot), -1)
            bad = np.flatnonzero((got != want).any(axis=1))
            if bad.size:
                i = int(bad[0])
                raise AssertionError(
                    f"region {key_label(spec.key)}: destination slot {int(d_slot[i])} (page "
                    f"{int(d_page[i])}) differs from source slot {int(s_slot[i])}"
                )

    def _expected(self, spec: RegionSpec, s_slot: np.ndarray, s_page: np.ndarray) -> np.ndarray:
        maps = self._page_map(spec)
        out = np.empty((len(s_slot), maps[0].size * spec.itemsize), dtype=np.uint8)
        for p in np.unique(s_page):
            rows = np.flatnonzero(s_page == p)
            out[rows] = _hash(spec, s_slot[rows], maps[p]).reshape(len(rows), -1)
        return out

    def audit(self, arrays: Mapping[Any, np.ndarray]) -> str:
        """What is non-zero in a decode rank's regions once every request was checked and
        reset (each slot is free again): a late or stray write. Empty when none."""
        for spec in self.specs:
            array = arrays.get(spec.key)
            if array is not None and array.size:
                dirty = np.flatnonzero(array.reshape(array.shape[0], -1).any(axis=1))
                if dirty.size:
                    return (
                        f"region {key_label(spec.key)}: slot {int(dirty[0])} holds bytes after "
                        f"every request ended ({dirty.size} slots): a write outside its request"
                    )
        return ""

    def reset(
        self, arrays: Mapping[Any, np.ndarray], request: dict[str, tuple[list[int], list[int]]]
    ) -> None:
        """Zero the destination slots of a checked request, so the next one proves its own."""
        for spec in self.specs:
            array = arrays.get(spec.key)
            if array is not None and array.size and spec.pool in request:
                array[np.asarray(request[spec.pool][1], dtype=np.int64)] = 0
