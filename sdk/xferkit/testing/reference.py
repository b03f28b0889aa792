"""The oracle: global tensors, sharded per rank by index arithmetic, copied byte by byte.

It shares no code with the planner on purpose: shards are taken with
``numpy.take`` over the global indices each rank holds, so a planner bug
cannot cancel itself out here. Engines and plugin authors reuse it to check
their own transfers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from ..descriptors import Descriptors
from ..manifest import AddressTable, Manifest, Region, RegionKey, key_label


class RegionSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A region as the model sees it: its *global* slot shape, before TP sharding."""

    pool: str
    name: str
    layer: int
    part: int = 0
    shape: tuple[int, ...]  # global slot shape
    itemsize: int = 2
    tp_axis: int | None = None
    tp_groups: tuple[int, ...] | None = None

    @property
    def key(self) -> RegionKey:
        return (self.pool, self.name, self.layer, self.part)


def held_indices(spec: RegionSpec, tp_rank: int, tp_size: int) -> np.ndarray | None:
    """Global indices of the sharded axis that ``tp_rank`` holds; None when replicated."""
    if spec.tp_axis is None:
        return None
    size = spec.shape[spec.tp_axis]
    if spec.tp_groups is not None:
        offsets = np.cumsum((0, *spec.tp_groups[:-1]))
        return np.concatenate(
            [
                off + np.arange(tp_rank * g // tp_size, (tp_rank + 1) * g // tp_size)
                for off, g in zip(offsets, spec.tp_groups, strict=True)
            ]
        ).astype(np.int64)
    local = -(-size // tp_size)  # the smallest share that covers the axis
    start = tp_rank * size // tp_size
    return np.arange(start, start + local, dtype=np.int64)


def shard(spec: RegionSpec, global_array: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    """What ``tp_rank`` holds of ``global_array`` (shape ``[slots, *spec.shape]``, bytes last)."""
    idx = held_indices(spec, tp_rank, tp_size)
    if idx is None or spec.tp_axis is None:
        return global_array.copy()
    return np.ascontiguousarray(np.take(global_array, idx, axis=1 + spec.tp_axis))


class Rank:
    """One rank's buffers and the manifest that describes them."""

    def __init__(
        self,
        specs: Sequence[RegionSpec],
        *,
        tp_rank: int,
        tp_size: int,
        pp_stage: int,
        fill: Mapping[RegionKey, np.ndarray],
    ) -> None:
        self.tp_rank, self.tp_size, self.pp_stage = tp_rank, tp_size, pp_stage
        self.arrays: dict[RegionKey, np.ndarray] = {}
        regions: list[Region] = []
        for spec in specs:
            # Bytes are the last axis of the model's arrays; the manifest sees itemsize.
            array = shard(spec, fill[spec.key], tp_rank, tp_size)
            self.arrays[spec.key] = array
            regions.append(_region_of(spec, array, tp_size))
        self.manifest = Manifest.build(regions, tp_rank=tp_rank, tp_size=tp_size)

    def snapshot(self) -> dict[RegionKey, np.ndarray]:
        return {k: a.copy() for k, a in self.arrays.items()}


def _region_of(spec: RegionSpec, array: np.ndarray, tp_size: int) -> Region:
    slot_shape = array.shape[1:-1]
    tp_global = None
    if spec.tp_axis is not None and spec.tp_groups is None:
        size = spec.shape[spec.tp_axis]
        if slot_shape[spec.tp_axis] * tp_size != size:
            tp_global = size
    # An empty tensor may have any address; the manifest drops it anyway.
    addr = 0 if array.size == 0 else array.ctypes.data
    return Region(
        pool=spec.pool,
        name=spec.name,
        layer=spec.layer,
        part=spec.part,
        addr=addr,
        nbytes=array.nbytes,
        slot_shape=tuple(slot_shape),
        itemsize=spec.itemsize,
        tp_axis=spec.tp_axis,
        tp_groups=spec.tp_groups,
        tp_global=tp_global,
    )


def _stage_of(layers: Iterable[int], pp_size: int) -> dict[int, int]:
    """Contiguous, nearly even split of the sorted layers over ``pp_size`` stages."""
    ordered = sorted(set(layers))
    return {layer: i * pp_size // len(ordered) for i, layer in enumerate(ordered)}


def _side(
    specs: Sequence[RegionSpec],
    tp_size: int,
    pp_size: int,
    fill: Mapping[RegionKey, np.ndarray],
) -> list[Rank]:
    stage = _stage_of((s.layer for s in specs), pp_size)
    return [
        Rank(
            [s for s in specs if stage[s.layer] == p],
            tp_rank=t,
            tp_size=tp_size,
            pp_stage=p,
            fill=fill,
        )
        for p in range(pp_size)
        for t in range(tp_size)
    ]


class Reference:
    """A prefill side and a decode side of one model, and what a handoff must produce.

    Source ranks hold shards of random global tensors; destination ranks start
    with a random sentinel pattern that ``check`` expects to see untouched
    outside the requested slots.
    """

    def __init__(
        self,
        specs: Sequence[RegionSpec],
        *,
        src_tp: int,
        dst_tp: int,
        src_slots: Mapping[str, int],
        dst_slots: Mapping[str, int],
        src_pp: int = 1,
        dst_pp: int = 1,
        seed: int = 0,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.specs = list(specs)
        self.global_src = {
            s.key: _random(rng, (src_slots[s.pool], *s.shape, s.itemsize)) for s in self.specs
        }
        sentinel = {
            s.key: _random(rng, (dst_slots[s.pool], *s.shape, s.itemsize)) for s in self.specs
        }
        self.srcs = _side(self.specs, src_tp, src_pp, self.global_src)
        self.dsts = _side(self.specs, dst_tp, dst_pp, sentinel)
        self._before = [d.snapshot() for d in self.dsts]

    def expected(self, dst_index: int, slots: Mapping[str, tuple[object, object]]) -> dict:
        """What ``dsts[dst_index]`` must hold after the request ``slots`` is transferred."""
        rank = self.dsts[dst_index]
        out = {k: a.copy() for k, a in self._before[dst_index].items()}
        for spec in self.specs:
            if spec.key not in rank.arrays or spec.pool not in slots:
                continue
            src_idx, dst_idx = (np.asarray(x, dtype=np.int64) for x in slots[spec.pool])
            rows = self.global_src[spec.key][src_idx]
            out[spec.key][dst_idx] = shard(spec, rows, rank.tp_rank, rank.tp_size)
        return out

    def check(self, dst_index: int, slots: Mapping[str, tuple[object, object]]) -> None:
        """AssertionError naming the first region whose bytes differ from the model."""
        rank = self.dsts[dst_index]
        for key, want in self.expected(dst_index, slots).items():
            got = rank.arrays[key]
            if not np.array_equal(got, want):
                diff = np.argwhere(got != want)[0]
                raise AssertionError(
                    f"dst rank {dst_index}: region {key_label(key)} differs from the reference "
                    f"first at index {tuple(int(i) for i in diff)} (slot {int(diff[0])})"
                )


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


class WriteCounter:
    """Counts how many times each byte of some ranks' regions is written.

    ``record`` costs O(descriptors): it marks where each write starts and ends
    (a difference array over all regions' bytes, laid end to end) and the
    per-byte counts are summed up only when asked for.
    """

    def __init__(self, ranks: Iterable[Rank]) -> None:
        manifests = [r.manifest for r in ranks]
        addrs = np.concatenate([m.addrs for m in manifests] or [np.zeros(0, np.uint64)])
        nbytes = np.concatenate([m.nbytes for m in manifests] or [np.zeros(0, np.uint64)])
        self._table = AddressTable(addrs, nbytes)
        self._addrs = addrs.astype(np.int64)
        self._base = np.cumsum(nbytes.astype(np.int64)) - nbytes.astype(np.int64)
        self._marks = np.zeros(int(nbytes.sum()) + 1, dtype=np.int32)

    def record(self, descs: Descriptors) -> None:
        """Add one write per byte of ``descs``; AssertionError for a write outside every region."""
        where = self._table.locate(descs.dst, descs.nbytes)
        bad = np.flatnonzero(where < 0)
        if bad.size:
            i = int(bad[0])
            raise AssertionError(
                f"descriptor {i} writes [{int(descs.dst[i]):#x}, +{int(descs.nbytes[i])}) "
                "outside every region"
            )
        start = self._base[where] + (descs.dst.astype(np.int64) - self._addrs[where])
        np.add.at(self._marks, start, 1)
        np.add.at(self._marks, start + descs.nbytes.astype(np.int64), -1)

    @property
    def counts(self) -> np.ndarray:
        """Writes per byte, all regions end to end (each rank's regions in manifest order)."""
        return np.cumsum(self._marks[:-1], dtype=np.int32)

    @property
    def max(self) -> int:
        counts = self.counts
        return int(counts.max()) if counts.size else 0


def execute(descs: Descriptors) -> None:
    """Perform the copies with plain memmove: the reference executor, slow and obvious."""
    for s, d, n in zip(descs.src.tolist(), descs.dst.tolist(), descs.nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, n)
