"""Per-region-pair geometry: what one source rank owes one destination rank within a slot.

For a pair of regions (one key, two ranks) this intersects what the source
holds of the sharded axis with what the destination needs, keeps the runs this
source is designated to write (a destination byte held by several source
ranks is written by exactly one), walks each run's box in the destination's
axis order and turns it into byte pieces, coalesced. It is pure and cached:
every plan of a model asks it the same few questions.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from ..arrays import c_strides
from ..descriptors import merge_neighbours
from ..manifest import PAGE_AXIS, Region
from ..sharding import AxisLayout, Segment, axis_layout

MAX_PIECES = 1 << 22
"""Most byte pieces within one slot: the table is built in memory, from sizes a peer claims."""


class Pieces(NamedTuple):
    """Byte pieces within one slot, sorted by destination offset, already coalesced."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray


class Alignment(NamedTuple):
    """How one region pair lines up: its piece table and how pages map onto slots.

    A slot of the side whose page axis is longer holds several pages of the
    other; the table is for its first page, page ``t`` sits ``t * shift`` bytes
    further.
    """

    pieces: Pieces
    src_pages: int  # pages of the destination's size per source slot
    dst_pages: int  # pages of the source's size per destination slot
    src_shift: int  # bytes between consecutive pages within a source slot
    dst_shift: int
    note: str  # how the two layouts differ ("" when alike): routes repeat it


class Geometry(NamedTuple):
    """The hashable part of a region that decides its pieces."""

    slot_shape: tuple[int, ...]
    itemsize: int
    tp_axis: int | None
    tp_groups: tuple[int, ...] | None
    tp_global: int | None
    axes: tuple[str, ...] | None


def geometry(r: Region) -> Geometry:
    return Geometry(r.slot_shape, r.itemsize, r.tp_axis, r.tp_groups, r.tp_global, r.axes)


EMPTY = np.zeros(0, dtype=np.uint64)
EMPTY.setflags(write=False)
NO_PIECES = Pieces(EMPTY, EMPTY, EMPTY)


class _Mismatch(Exception):
    """Why a region pair cannot line up; ``align`` returns its text (and caches it)."""


class _Frame(NamedTuple):
    """The destination's axes in the source's order (paired by name when both sides name them)."""

    perm: tuple[int, ...]  # perm[j]: the source axis that is the destination's axis j
    inv: tuple[int, ...]  # inv[i]: the destination axis that is the source's axis i
    page: int | None  # the source axis named PAGE_AXIS
    shape: tuple[int, ...]  # the destination's slot shape, in source axis order


Run = tuple[int, int, int, int]
"""(global start, length, source local start, destination local start) along the sharded axis."""

Dims = list[tuple[int, int, int]]
"""(count, source stride, destination stride) per axis, outer first."""

Cut = tuple[tuple[int, Dims], int, int]
"""((piece length, grid), source offset, destination offset) of one run."""


@lru_cache(maxsize=4096)
def align(a: Geometry, s: int, ts: int, b: Geometry, d: int, td: int) -> Alignment | str:
    """What source rank s (of ts) owes destination rank d (of td) within a slot, or why
    nothing can be.

    Axes are numbered as the source orders them.
    """
    a, b = _scalars_as_vectors(a, b)
    try:
        frame = _frame(a, b)
        axis, sharded = _shard_axis(a, b, frame)
        ks, kd = _page_ratio(a, b, frame, axis, sharded)
        # The box one page pair spans: the shorter page, the whole of every other axis.
        box = tuple(min(na, nb) for na, nb in zip(a.slot_shape, frame.shape, strict=True))
        runs = _owned(a, s, ts, b, d, td, frame, axis, sharded, box[axis])
        cuts = _cuts(a, b, frame, axis, box, runs)
        _bound(cuts, kd, a, axis)
    except _Mismatch as why:
        return str(why)
    pieces = coalesce(*_enumerate(cuts)) if cuts else NO_PIECES
    s_shift, d_shift = _page_shifts(a, b, frame, box, ks, kd)
    return Alignment(pieces, ks, kd, s_shift, d_shift, _note(a, b, frame.perm, ks, kd))


def _scalars_as_vectors(a: Geometry, b: Geometry) -> tuple[Geometry, Geometry]:
    """One scalar per slot on both sides is a slot of one element."""
    if not a.slot_shape and not b.slot_shape:
        return a._replace(slot_shape=(1,), axes=None), b._replace(slot_shape=(1,), axes=None)
    return a, b


def _frame(a: Geometry, b: Geometry) -> _Frame:
    """Pair the two sides' axes: by name when both name them, else by position."""
    if a.itemsize != b.itemsize:
        raise _Mismatch(
            f"itemsize differs: {a.itemsize} on the source, {b.itemsize} on the destination"
        )
    if len(a.slot_shape) != len(b.slot_shape):
        raise _Mismatch(
            f"slot_shape {a.slot_shape} on the source, {b.slot_shape} on the destination"
        )
    ndim = len(a.slot_shape)
    perm, page = tuple(range(ndim)), None
    if a.axes is not None and b.axes is not None:
        if sorted(a.axes) != sorted(b.axes):
            raise _Mismatch(f"axes {a.axes} on the source, {b.axes} on the destination")
        where = {name: i for i, name in enumerate(a.axes)}
        perm = tuple(where[name] for name in b.axes)
        page = where.get(PAGE_AXIS)
    inv = [0] * ndim
    for j, i in enumerate(perm):
        inv[i] = j
    shape = tuple(b.slot_shape[inv[i]] for i in range(ndim))
    return _Frame(perm, tuple(inv), page, shape)


def _shard_axis(a: Geometry, b: Geometry, f: _Frame) -> tuple[int, bool]:
    """(the sharded axis, whether either side shards it): both sides must shard the same one."""
    tb = None if b.tp_axis is None else f.perm[b.tp_axis]
    if a.tp_axis is not None and tb is not None and a.tp_axis != tb:
        sides = _axis(a, a.tp_axis), _axis(b, f.inv[tb])
        raise _Mismatch(f"sharded along {sides[0]} on the source, {sides[1]} on the destination")
    axis = a.tp_axis if a.tp_axis is not None else (tb if tb is not None else 0)
    return axis, a.tp_axis is not None or tb is not None


def _page_ratio(a: Geometry, b: Geometry, f: _Frame, axis: int, sharded: bool) -> tuple[int, int]:
    """(source, destination) pages per slot: only the page axis may differ, by a whole factor."""
    ks = kd = 1
    for i, (na, nb) in enumerate(zip(a.slot_shape, f.shape, strict=True)):
        if (sharded and i == axis) or na == nb:
            continue
        if i == f.page and min(na, nb) and max(na, nb) % min(na, nb) == 0:
            ks, kd = max(na // nb, 1), max(nb // na, 1)
            continue
        raise _Mismatch(
            f"non-sharded dims differ: slot_shape {a.slot_shape} on the source, "
            f"{b.slot_shape} on the destination (sharded axis {axis}"
            + (f"; {PAGE_AXIS!r} may differ by a whole factor)" if f.page is not None else ")")
        )
    return ks, kd


def _owned(
    a: Geometry,
    s: int,
    ts: int,
    b: Geometry,
    d: int,
    td: int,
    f: _Frame,
    axis: int,
    sharded: bool,
    length: int,
) -> list[Run]:
    """The runs of the sharded axis that source rank s writes into destination rank d."""
    if not sharded:  # replicated on both sides: one replica writes it all
        return [(0, length, 0, 0)] if d % ts == s else []
    la, lb = _layout(a, axis, ts), _layout(b, f.inv[axis], td)
    if la.size != lb.size:
        raise _Mismatch(
            f"global size of axis {axis} differs: {la.size} on the source "
            f"(local {a.slot_shape[axis]} at TP {ts}), {lb.size} on the destination "
            f"(local {f.shape[axis]} at TP {td})"
        )
    problem = _group_mismatch(la, lb)
    if problem:
        raise _Mismatch(problem)
    return _owned_runs(la, s, lb.segments(d), d)


def _cuts(
    a: Geometry, b: Geometry, f: _Frame, axis: int, box: tuple[int, ...], runs: list[Run]
) -> list[Cut]:
    """Each run's box as a piece length and a grid, walked in the destination's axis order."""
    sa = c_strides(a.slot_shape, a.itemsize)
    db = c_strides(b.slot_shape, b.itemsize)
    sb = [db[f.inv[i]] for i in range(len(sa))]
    cuts = []
    for _, length, s_at, d_at in runs:
        run_box = [length if i == axis else n for i, n in enumerate(box)]
        dims = [(run_box[i], sa[i], sb[i]) for i in f.perm]  # destination order, outer first
        cuts.append((_collapse(dims, a.itemsize), s_at * sa[axis], d_at * sb[axis]))
    return cuts


def _bound(cuts: list[Cut], kd: int, a: Geometry, axis: int) -> None:
    """Bounded before anything is allocated; coverage walks every destination page."""
    count = sum(math.prod(n for n, _, _ in grid) for (_, grid), _, _ in cuts) * kd
    if count > MAX_PIECES:
        raise _Mismatch(
            f"one slot would need {count} pieces (more than {MAX_PIECES}): the sharded axis "
            f"{axis} of slot_shape {a.slot_shape} lies under too many rows, or the layouts "
            "transpose too finely; shard an outer axis"
        )


def _page_shifts(
    a: Geometry, b: Geometry, f: _Frame, box: tuple[int, ...], ks: int, kd: int
) -> tuple[int, int]:
    """Bytes between consecutive pages within a long slot, on each side (0: one page a slot)."""
    if f.page is None:
        return 0, 0
    sa = c_strides(a.slot_shape, a.itemsize)[f.page]
    sb = c_strides(b.slot_shape, b.itemsize)[f.inv[f.page]]
    return (box[f.page] * sa if ks > 1 else 0), (box[f.page] * sb if kd > 1 else 0)


def _axis(g: Geometry, i: int) -> str:
    return f"axis {i}" + (f" ({g.axes[i]!r})" if g.axes is not None else "")


def _collapse(dims: Dims, itemsize: int) -> tuple[int, Dims]:
    """(piece length, grid): merge axes contiguous on both sides into their outer neighbour;
    the innermost, when unit-strided on both sides, becomes the piece, the rest the grid."""
    merged: Dims = []
    for n, ss, ds in dims:
        if n == 1:
            continue
        if merged and merged[-1][1] == ss * n and merged[-1][2] == ds * n:
            merged[-1] = (merged[-1][0] * n, ss, ds)
        else:
            merged.append((n, ss, ds))
    if merged and merged[-1][1] == merged[-1][2] == itemsize:
        return merged[-1][0] * itemsize, merged[:-1]
    return itemsize, merged


def _enumerate(cuts: list[Cut]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every piece of every run: one broadcast per axis of the grid, never per piece."""
    src, dst, nbytes = [], [], []
    for (length, grid), s0, d0 in cuts:
        s, d = np.array([s0], dtype=np.uint64), np.array([d0], dtype=np.uint64)
        for n, ss, ds in grid:
            step = np.arange(n, dtype=np.uint64)
            s = (s[:, None] + step * np.uint64(ss)).ravel()
            d = (d[:, None] + step * np.uint64(ds)).ravel()
        src.append(s)
        dst.append(d)
        nbytes.append(np.full(s.size, length, dtype=np.uint64))
    return np.concatenate(src), np.concatenate(dst), np.concatenate(nbytes)


def coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Pieces:
    """Sort pieces by destination and merge neighbours contiguous on both sides."""
    order = np.argsort(dst, kind="stable")
    out = Pieces(*merge_neighbours(src[order], dst[order], nbytes[order]))
    for array in out:
        array.setflags(write=False)  # tables are cached and shared between plans
    return out


def _note(a: Geometry, b: Geometry, perm: tuple[int, ...], ks: int, kd: int) -> str:
    parts = []
    if perm != tuple(range(len(perm))):
        parts.append(f"axes {a.axes} on the source, {b.axes} on the destination")
    if ks > 1:
        parts.append(f"a source slot holds {ks} destination pages")
    if kd > 1:
        parts.append(f"a destination slot holds {kd} source pages")
    return "; ".join(parts)


def _layout(g: Geometry, axis: int, tp_size: int) -> AxisLayout:
    """How ``g``'s axis ``axis`` (its own numbering) splits over ``tp_size`` ranks."""
    if g.tp_axis is None:
        n = g.slot_shape[axis]
        return AxisLayout(n, n, (n,), tp_size, replicated=True)
    return axis_layout(g.slot_shape[axis], tp_size, g.tp_groups, g.tp_global)


def _group_mismatch(la: AxisLayout, lb: AxisLayout) -> str | None:
    if la.groups == lb.groups or la.whole or lb.whole:
        return None
    if len(la.groups) > 1 and len(lb.groups) > 1:
        return f"shard groups differ: {la.groups} on the source, {lb.groups} on the destination"
    grouped, flat, flat_tp = (
        ("source", "destination", lb.tp_size)
        if len(la.groups) > 1
        else ("destination", "source", la.tp_size)
    )
    groups = la.groups if len(la.groups) > 1 else lb.groups
    return (
        f"inexpressible split: the {grouped} shards the axis as groups {groups}, "
        f"the {flat} as one block over TP {flat_tp}"
    )


def _owned_runs(src_layout: AxisLayout, s: int, wanted: tuple[Segment, ...], d: int) -> list[Run]:
    """The runs of the axis that rank s writes to d.

    An index held by several source ranks is written by the holder at position
    ``d % holders`` among them: every pair can decide alone, no index is
    written twice, and replicas share the load across destination ranks.
    """
    held = [src_layout.segments(r) for r in range(src_layout.tp_size)]
    mine = held[s]
    cuts = sorted(
        {x for segs in held for seg in segs for x in (seg.start, seg.start + seg.length)}
        | {x for seg in wanted for x in (seg.start, seg.start + seg.length)}
    )
    runs = []
    for lo, hi in pairwise(cuts):
        dst_seg = _covering(wanted, lo)
        src_seg = _covering(mine, lo)
        if dst_seg is None or src_seg is None:
            continue
        holders = [r for r in range(src_layout.tp_size) if _covering(held[r], lo) is not None]
        if holders[d % len(holders)] != s:
            continue
        runs.append(
            (lo, hi - lo, src_seg.local + lo - src_seg.start, dst_seg.local + lo - dst_seg.start)
        )
    return runs


def _covering(segs: tuple[Segment, ...], x: int) -> Segment | None:
    for seg in segs:
        if seg.start <= x < seg.start + seg.length:
            return seg
    return None
