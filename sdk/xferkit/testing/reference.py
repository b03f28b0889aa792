"""The oracle: global tensors, sharded per rank by index arithmetic, copied byte by byte.

It shares no code with the planner on purpose: shards are taken with
``numpy.take`` over the global indices each rank holds, each side's memory
order is a plain ``numpy.transpose`` of the model's canonical axes, and pages
are found by splitting the token axis, so a planner bug cannot cancel itself
out here. Engines and plugin authors reuse it to check their own transfers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np

from ..descriptors import Descriptors
from ..manifest import PAGE_AXIS, AddressTable, Manifest, Region, RegionKey, key_label

Side = Literal["src", "dst"]


class RegionSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A region as the model sees it: its *global* slot shape, before TP sharding.

    ``shape`` is in the model's canonical axis order, named by ``axes`` (None:
    unnamed, so both sides pair positionally). Each side may lay the axes out
    in its own order (``src_order`` / ``dst_order``: the canonical axes in
    memory order, None for canonical) and, when an axis is named
    ``PAGE_AXIS``, hold several model pages of ``shape[token axis]`` tokens in
    one slot (``src_pages`` / ``dst_pages``; the larger a multiple of the
    smaller). ``tp_axis`` indexes the canonical shape. ValueError for a spec
    the model cannot describe.
    """

    pool: str
    name: str
    layer: int
    part: int = 0
    shape: tuple[int, ...]  # global slot shape, canonical order, one model page of tokens
    itemsize: int = 2
    tp_axis: int | None = None
    tp_groups: tuple[int, ...] | None = None
    axes: tuple[str, ...] | None = None
    src_order: tuple[int, ...] | None = None
    dst_order: tuple[int, ...] | None = None
    src_pages: int = 1
    dst_pages: int = 1

    def __post_init__(self) -> None:
        label = key_label(self.key)
        ndim = len(self.shape)
        if self.axes is not None and (len(self.axes) != ndim or len(set(self.axes)) != ndim):
            raise ValueError(f"{label}: axes {self.axes} must name each axis of {self.shape} once")
        for order in (self.src_order, self.dst_order):
            if order is None:
                continue
            if sorted(order) != list(range(ndim)):
                raise ValueError(f"{label}: order {order} is not a permutation of {ndim} axes")
            if self.axes is None and order != tuple(range(ndim)):
                raise ValueError(f"{label}: unnamed axes pair by position: no reordering")
        lo, hi = sorted((self.src_pages, self.dst_pages))
        if lo < 1 or hi % lo:
            raise ValueError(f"{label}: pages {self.src_pages} and {self.dst_pages}")
        if hi > 1 and (self.token_axis is None or self.token_axis == self.tp_axis):
            raise ValueError(f"{label}: several pages a slot need an unsharded {PAGE_AXIS!r} axis")

    @property
    def key(self) -> RegionKey:
        return (self.pool, self.name, self.layer, self.part)

    @property
    def token_axis(self) -> int | None:
        """The canonical index of the ``PAGE_AXIS``, None when there is none."""
        if self.axes is None or PAGE_AXIS not in self.axes:
            return None
        return self.axes.index(PAGE_AXIS)

    def order(self, side: Side) -> tuple[int, ...]:
        """The canonical axes in ``side``'s memory order."""
        order = self.src_order if side == "src" else self.dst_order
        return tuple(range(len(self.shape))) if order is None else order

    def pages(self, side: Side) -> int:
        """Model pages one slot of ``side`` holds."""
        return self.src_pages if side == "src" else self.dst_pages

    def side_shape(self, side: Side) -> tuple[int, ...]:
        """The global slot shape of ``side``, canonical order (the token axis times its pages)."""
        shape = list(self.shape)
        t = self.token_axis
        if t is not None:
            shape[t] *= self.pages(side)
        return tuple(shape)


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
    """What ``tp_rank`` holds of ``global_array`` (``[slots, *spec.shape, bytes]``, canonical)."""
    idx = held_indices(spec, tp_rank, tp_size)
    if idx is None or spec.tp_axis is None:
        return global_array.copy()
    return np.ascontiguousarray(np.take(global_array, idx, axis=1 + spec.tp_axis))


def to_side(spec: RegionSpec, side: Side, array: np.ndarray) -> np.ndarray:
    """A canonical ``[slots, *axes, bytes]`` array transposed into ``side``'s memory order."""
    order = spec.order(side)
    return np.ascontiguousarray(np.transpose(array, (0, *(1 + i for i in order), array.ndim - 1)))


def paged(array: np.ndarray, token_axis: int | None, pages: int) -> np.ndarray:
    """A view ``[slots, pages, ...]`` of a contiguous ``[slots, ..., bytes]`` array whose axis
    ``1 + token_axis`` holds ``pages`` pages: that axis split, its page index moved to 1.
    With no token axis every slot is one page."""
    if token_axis is None:
        return array[:, None]
    a = 1 + token_axis
    shape = array.shape
    split = array.reshape(*shape[:a], pages, shape[a] // pages, *shape[a + 1 :])
    assert np.may_share_memory(split, array) or not array.size  # a view: writes land
    return np.moveaxis(split, a, 1)


def page_pairs(
    spec: RegionSpec, src: object, dst: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source slot, source page, destination slot, destination page) of each model page a
    request moves for ``spec``: the slots' pages laid end to end on each side, paired in
    order, as many as the shorter side holds; ValueError when a named slot takes no part."""
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    sp, dp = spec.src_pages, spec.dst_pages
    q = min(s.size * sp, d.size * dp)
    if q <= (s.size - 1) * sp or q <= (d.size - 1) * dp:
        raise ValueError(
            f"{key_label(spec.key)}: {s.size} source slots of {sp} pages and {d.size} "
            f"destination slots of {dp} pages do not pair"
        )
    page = np.arange(q, dtype=np.int64)
    return s[page // sp], page % sp, d[page // dp], page % dp


class Rank:
    """One rank's buffers and the manifest that describes them.

    ``fill`` holds each spec's global tensor of ``side`` (canonical order);
    the rank keeps its shard in ``side``'s memory order, where ``place`` puts it
    (an array of the same shape and bytes; numpy's own allocation without it).
    """

    def __init__(
        self,
        specs: Sequence[RegionSpec],
        *,
        tp_rank: int,
        tp_size: int,
        pp_stage: int,
        fill: Mapping[RegionKey, np.ndarray],
        side: Side = "src",
        place: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.tp_rank, self.tp_size, self.pp_stage = tp_rank, tp_size, pp_stage
        self.side = side
        self.arrays: dict[RegionKey, np.ndarray] = {}
        regions: list[Region] = []
        for spec in specs:
            # Bytes are the last axis of the model's arrays; the manifest sees itemsize.
            canonical = shard(spec, fill[spec.key], tp_rank, tp_size)
            array = to_side(spec, side, canonical)
            if place is not None:
                array = place(array)
            self.arrays[spec.key] = array
            regions.append(_region_of(spec, side, array, canonical.shape[1:-1], tp_size))
        self.manifest = Manifest.build(regions, tp_rank=tp_rank, tp_size=tp_size)

    def snapshot(self) -> dict[RegionKey, np.ndarray]:
        return {k: a.copy() for k, a in self.arrays.items()}


def _region_of(
    spec: RegionSpec,
    side: Side,
    array: np.ndarray,
    canonical: tuple[int, ...],
    tp_size: int,
) -> Region:
    order = spec.order(side)
    tp_axis = tp_global = None
    if spec.tp_axis is not None:
        tp_axis = order.index(spec.tp_axis)
        size = spec.shape[spec.tp_axis]
        if spec.tp_groups is None and canonical[spec.tp_axis] * tp_size != size:
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
        slot_shape=tuple(array.shape[1:-1]),
        itemsize=spec.itemsize,
        tp_axis=tp_axis,
        tp_groups=spec.tp_groups,
        tp_global=tp_global,
        axes=None if spec.axes is None else tuple(spec.axes[i] for i in order),
    )


def _stage_of(layers: Iterable[int], pp_size: int) -> dict[int, int]:
    """Contiguous, nearly even split of the sorted layers over ``pp_size`` stages."""
    ordered = sorted(set(layers))
    return {layer: i * pp_size // len(ordered) for i, layer in enumerate(ordered)}


def _side(
    specs: Sequence[RegionSpec],
    side: Side,
    tp_size: int,
    pp_size: int,
    fill: Mapping[RegionKey, np.ndarray],
) -> list[Rank]:
    stage = _stage_of((s.layer for s in specs), pp_size)
    ranks = []
    for p in range(pp_size):
        mine = [s for s in specs if stage[s.layer] == p]
        for t in range(tp_size):
            end_to_end = Blocks(sum(fill[s.key].nbytes for s in mine) // tp_size)
            ranks.append(
                Rank(
                    mine,
                    tp_rank=t,
                    tp_size=tp_size,
                    pp_stage=p,
                    fill=fill,
                    side=side,
                    place=end_to_end,
                )
            )
    return ranks


class Blocks:
    """Places arrays one after another in large blocks of memory, each on an ``align``-byte
    boundary, as an engine carves its layers out of big allocations. With ``align=1`` one
    region ends where the next begins: a copy merged across that boundary would look
    contiguous while no driver may take it (each registration is its own). Arrays of
    ``keep_from`` bytes or more stay where they are (a block of their own already)."""

    def __init__(self, block: int, *, align: int = 1, keep_from: int | None = None) -> None:
        self._block, self._align, self._keep_from = block, align, keep_from
        self._buffer = np.empty(0, dtype=np.uint8)
        self._at = 0

    def __call__(self, array: np.ndarray) -> np.ndarray:
        n = array.nbytes
        if not n or (self._keep_from is not None and n >= self._keep_from):
            return array
        if self._at + n > self._buffer.size:
            raw = np.empty(max(n, self._block) + self._align - 1, dtype=np.uint8)
            start = -raw.ctypes.data % self._align
            self._buffer, self._at = raw[start : start + max(n, self._block)], 0
        home = self._buffer[self._at : self._at + n].view(array.dtype).reshape(array.shape)
        home[...] = array
        self._at += -(-n // self._align) * self._align
        return home


class Reference:
    """A prefill side and a decode side of one model, and what a handoff must produce.

    Source ranks hold shards of random global tensors (``global_src[key]``:
    ``[src_slots, *spec.side_shape("src"), itemsize]``); destination ranks
    start with a random sentinel pattern that ``check`` expects to see
    untouched outside the requested pages.
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
        self.by_key = {s.key: s for s in self.specs}
        self.global_src = {
            s.key: _random(rng, (src_slots[s.pool], *s.side_shape("src"), s.itemsize))
            for s in self.specs
        }
        sentinel = {
            s.key: _random(rng, (dst_slots[s.pool], *s.side_shape("dst"), s.itemsize))
            for s in self.specs
        }
        self.srcs = _side(self.specs, "src", src_tp, src_pp, self.global_src)
        self.dsts = _side(self.specs, "dst", dst_tp, dst_pp, sentinel)
        self._before = [d.snapshot() for d in self.dsts]

    def expected(self, dst_index: int, slots: Mapping[str, tuple[object, object]]) -> dict:
        """What ``dsts[dst_index]`` must hold after the request ``slots`` is transferred.

        Per pool, ``(source slots, destination slots)`` in the caller's order: the
        slots' model pages laid end to end on each side pair in order (``page_pairs``).
        """
        rank = self.dsts[dst_index]
        out = {k: a.copy() for k, a in self._before[dst_index].items()}
        for spec in self.specs:
            if spec.key not in rank.arrays or spec.pool not in slots:
                continue
            s_slot, s_page, d_slot, d_page = page_pairs(spec, *slots[spec.pool])
            t = spec.token_axis
            rows = paged(self.global_src[spec.key], t, spec.src_pages)[s_slot, s_page]
            local = to_side(spec, "dst", shard(spec, rows, rank.tp_rank, rank.tp_size))
            # The token axis's place in the destination's memory order.
            t_dst = None if t is None else spec.order("dst").index(t)
            paged(out[spec.key], t_dst, spec.dst_pages)[d_slot, d_page] = local
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
