"""Turn two manifests into the byte copies one source rank owes one destination rank.

Planning is pure and happens once per manifest pair: for every region key the
two sides share, it intersects what the source rank holds with what the
destination rank needs and keeps the part this source is designated to write
(a destination byte held by several source ranks is written by exactly one).
The result is a table of pieces within one slot. ``Plan.expand`` is the
per-request cost: it broadcasts that table over the request's slot pairs and
coalesces pieces contiguous on both sides, in numpy, with no per-slot loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from .arguments import expect
from .arrays import c_strides
from .descriptors import Descriptors, merge_neighbours
from .errors import ArgumentError, PlanError
from .manifest import PAGE_AXIS, STAGING_POOL, Manifest, Region, RegionKey, key_label
from .sharding import AxisLayout, Segment, axis_layout


class Pieces(NamedTuple):
    """Byte pieces within one slot, sorted by destination offset, already coalesced."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray


class _Pairing(NamedTuple):
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


class _Group(NamedTuple):
    """Regions of one pool sharing slot sizes and a pairing: expanded in one broadcast."""

    pool: str
    keys: tuple[RegionKey, ...]
    src_base: np.ndarray  # (R,) uint64
    dst_base: np.ndarray
    src_stride: int
    dst_stride: int
    pairing: _Pairing
    src_span: np.uint64  # from a page's first piece (in destination order) to its last's end
    dst_span: np.uint64

    @property
    def pieces(self) -> Pieces:
        return self.pairing.pieces


class Pairs(NamedTuple):
    """A request's page pairs for one pool, sorted by destination: slot indices, the page
    within each slot (None when every slot is one page) and which pair of the request, in the
    caller's order, each is (None: that order already). Both sides of a Session know the
    caller's order, not the other's slots."""

    src: np.ndarray
    dst: np.ndarray
    src_page: np.ndarray | None
    dst_page: np.ndarray | None
    order: np.ndarray | None

    def offsets(self, g: _Group) -> tuple[np.ndarray, np.ndarray]:
        """Byte offset of each pair's page within ``g``'s regions, on both sides."""
        s = self.src * np.uint64(g.src_stride)
        d = self.dst * np.uint64(g.dst_stride)
        if self.src_page is not None:
            s += self.src_page * np.uint64(g.pairing.src_shift)
        if self.dst_page is not None:
            d += self.dst_page * np.uint64(g.pairing.dst_shift)
        return s, d


class Plan:
    """What source rank ``src_rank`` writes into destination rank ``dst_rank``.

    Compute once per manifest pair with ``plan(src, dst)``; call ``expand`` per request.
    """

    __slots__ = (
        "_groups",
        "_known",
        "_origin",
        "_pages",
        "_pairings",
        "dst_rank",
        "dst_slots",
        "src_rank",
        "src_slots",
    )

    def __init__(
        self,
        src: Manifest,
        dst: Manifest,
        groups: list[_Group],
        pairings: dict[RegionKey, _Pairing],
        pages: dict[str, tuple[int, int]],
    ) -> None:
        self.src_rank = src.tp_rank
        self.dst_rank = dst.tp_rank
        self.src_slots = dict(src.pools)
        self.dst_slots = dict(dst.pools)
        # A request is one destination rank's: it may name any pool that rank has, even
        # one whose regions were all dropped or that this source's pipeline stage lacks.
        self._known = (set(dst.pools) | {k[0] for k in dst.dropped_keys}) - {STAGING_POOL}
        self._groups = groups
        self._pairings = pairings
        self._pages = pages
        self._origin = (src, dst)

    @property
    def keys(self) -> tuple[RegionKey, ...]:
        """Region keys this source writes something into."""
        return tuple(k for g in self._groups for k in g.keys)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(sorted({g.pool for g in self._groups}))

    @property
    def empty(self) -> bool:
        """True when this source owes this destination nothing."""
        return not self._groups

    def _pairing(self, key: object) -> _Pairing | None:
        try:
            return self._pairings.get(key)  # type: ignore[call-overload]
        except TypeError:  # unhashable: no key of ours
            msg = f"a region key is a (pool, name, layer, part) tuple, not {key!r}"
            raise PlanError(msg) from None

    def pieces(self, key: RegionKey) -> Pieces:
        """The copies within one page of ``key`` (empty when this source writes none of it)."""
        pairing = self._pairing(key)
        return _NO_PIECES if pairing is None else pairing.pieces

    def pages(self, pool: str) -> tuple[int, int] | None:
        """(source, destination) pages per slot of ``pool``: ``(1, 4)`` when a destination slot
        holds four source slots' tokens (``Region.axes``), ``(1, 1)`` when slots pair one to
        one; None when no region of ``pool`` pairs here (another stage's, or all dropped), so
        nothing of it moves between these two ranks."""
        expect(pool, str, "Plan.pages() (a pool name)")
        return self._pages.get(pool)

    def describe(self, key: RegionKey) -> str:
        """How the two sides' layouts of ``key`` line up ("" when alike)."""
        pairing = self._pairing(key)
        return "" if pairing is None else pairing.note

    def expand(self, request: Mapping[str, tuple[object, object]]) -> Descriptors:
        """Descriptors for a request: ``request[pool] = (src_slot_indices, dst_slot_indices)``.

        Pools of the plan absent from ``request`` are not transferred. Every input
        is checked before anything is produced.
        """
        expect(request, Mapping, "Plan.expand() (pool -> (src_slots, dst_slots))")
        requests = {pool: self._slot_runs(pool, pair) for pool, pair in request.items()}
        return self._expand(requests, self._groups)

    def _expand(self, requests: Mapping[str, Pairs], groups: list[_Group]) -> Descriptors:
        """Descriptors of ``groups`` for validated pairs (``staging`` expands a subset)."""
        parts = [_expand_group(g, requests[g.pool]) for g in groups if g.pool in requests]
        out = Descriptors.sealed(sum(count for count, _ in parts), *self._origin)
        at = 0
        with out.filling() as (s, d, n):
            for count, fill in parts:
                fill(s[at : at + count], d[at : at + count], n[at : at + count])
                at += count
        return out

    def _slot_runs(self, pool: str, pair: tuple[object, object]) -> Pairs:
        if pool not in self._known:
            known = sorted(self._known)
            raise PlanError(f"unknown pool {pool!r}; the destination has {known}", subject=pool)
        try:
            src_raw, dst_raw = pair
        except (TypeError, ValueError):
            raise PlanError(
                f"pool {pool!r}: expected (src_slot_indices, dst_slot_indices)", subject=pool
            ) from None
        src = _indices(src_raw, pool, "source", self.src_slots.get(pool))
        dst = _indices(dst_raw, pool, "destination", self.dst_slots.get(pool))
        pages = self._pages.get(pool)
        if pages is None:  # nothing of the pool moves here: its slots pair with nothing
            return Pairs(src[:0], dst[:0], None, None, None)
        ks, kd = pages
        if ks == kd == 1:
            if src.shape != dst.shape:
                raise PlanError(
                    f"pool {pool!r}: {src.size} source slots but {dst.size} destination slots",
                    subject=pool,
                )
            if dst.size <= 1:  # one slot (a decode step's page): nothing to order or join
                return Pairs(src, dst, None, None, None)
        order = np.argsort(dst, kind="stable")
        ordered = dst[order]
        same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if same.size:
            raise PlanError(
                f"pool {pool!r}: destination slot {int(ordered[same[0]])} is requested twice",
                subject=pool,
            )
        if ks == kd == 1:
            return Pairs(src[order], ordered, None, None, order)
        return _paged_pairs(pool, src, dst, ks, kd)


def _paged_pairs(pool: str, src: np.ndarray, dst: np.ndarray, ks: int, kd: int) -> Pairs:
    """Page j of the request is page ``j % ks`` of ``src[j // ks]`` and ``j % kd`` of
    ``dst[j // kd]``; every slot named takes part (a last coarse slot may be partly used)."""
    n = min(src.size * ks, dst.size * kd)
    if n <= (src.size - 1) * ks or n <= (dst.size - 1) * kd:
        fine, coarse = ("source", "destination") if kd > 1 else ("destination", "source")
        k = max(ks, kd)
        raise PlanError(
            f"pool {pool!r}: {src.size} source slots but {dst.size} destination slots, where a "
            f"{coarse} slot holds {k} {fine} slots: the {coarse} needs "
            f"ceil(n / {k}) slots for n {fine} slots",
            subject=pool,
        )
    j = np.arange(n, dtype=np.uint64)
    s_slot, s_page = src[j // np.uint64(ks)], j % np.uint64(ks)
    d_slot, d_page = dst[j // np.uint64(kd)], j % np.uint64(kd)
    order = np.argsort(d_slot * np.uint64(kd) + d_page, kind="stable")
    return Pairs(
        s_slot[order],
        d_slot[order],
        s_page[order] if ks > 1 else None,
        d_page[order] if kd > 1 else None,
        order,
    )


_EMPTY = np.zeros(0, dtype=np.uint64)
_EMPTY.setflags(write=False)
_NO_PIECES = Pieces(_EMPTY, _EMPTY, _EMPTY)
_NO_RUNS = np.zeros(0, dtype=bool)
_NO_RUNS.setflags(write=False)


def _indices(raw: object, pool: str, side: str, count: int | None) -> np.ndarray:
    """Validated slot indices; ``count`` is None when that side holds no region of the pool."""
    arr = np.asarray(raw)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise PlanError(
            f"pool {pool!r}: {side} slot indices must be a 1-D integer array, "
            f"got shape {arr.shape} dtype {arr.dtype}",
            subject=pool,
        )
    if arr.size:
        lo, hi = (int(arr[0]),) * 2 if arr.size == 1 else (int(arr.min()), int(arr.max()))
        if lo < 0 or (count is not None and hi >= count):
            bad = lo if lo < 0 else hi
            raise PlanError(
                f"pool {pool!r}: {side} slot {bad} is out of range [0, {count})", subject=pool
            )
    return arr.astype(np.uint64, copy=False)


_FIRST = np.zeros(1, dtype=np.intp)
_FIRST.setflags(write=False)

Fill = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
"""Writes a group's descriptors into (src, dst, nbytes) slices of the request's final arrays."""


def _expand_group(g: _Group, pairs: Pairs) -> tuple[int, Fill]:
    """(descriptor count, filler): the final arrays are allocated once, sealed, then filled."""
    n, regions = pairs.src.size, g.src_base.size
    if n == 0:
        return 0, lambda *out: None
    src, dst = pairs.offsets(g)
    table = g.pairing.pieces
    pieces = table.src.size
    # Page i+1 continues page i where its first piece starts where page i's last one ends,
    # on both sides (consecutive whole pages, a head's run of short pages in a long one).
    cont = _NO_RUNS
    if n > 1:
        cont = (src[1:] == src[:-1] + g.src_span) & (dst[1:] == dst[:-1] + g.dst_span)
    if pieces == 1:
        # Runs of continuing pages become one descriptor per region.
        unit = np.uint64(table.nbytes[0])
        if n == 1:
            starts, lengths = _FIRST, np.full(1, unit, dtype=np.uint64)
        else:
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            lengths = np.diff(np.append(starts, n)).astype(np.uint64) * unit
        s_off = src[starts] + table.src[0]
        d_off = dst[starts] + table.dst[0]

        def fill_runs(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
            shape = (regions, starts.size)
            np.add(g.src_base[:, None], s_off[None, :], out=out_s.reshape(shape))
            np.add(g.dst_base[:, None], d_off[None, :], out=out_d.reshape(shape))
            out_n.reshape(shape)[:] = lengths[None, :]

        return regions * starts.size, fill_runs
    # Offsets within a region first (n*P), then one pass adds each region's base.
    s_off = (src[:, None] + table.src[None, :]).ravel()
    d_off = (dst[:, None] + table.dst[None, :]).ravel()
    if not cont.any():

        def fill_pieces(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
            shape = (regions, n * pieces)
            np.add(g.src_base[:, None], s_off[None, :], out=out_s.reshape(shape))
            np.add(g.dst_base[:, None], d_off[None, :], out=out_d.reshape(shape))
            out_n.reshape(regions * n, pieces)[:] = table.nbytes[None, :]

        return regions * n * pieces, fill_pieces
    # The last piece of page i joins the first piece of page i+1 where it continues.
    s = (g.src_base[:, None] + s_off[None, :]).ravel()
    d = (g.dst_base[:, None] + d_off[None, :]).ravel()
    ln = np.tile(table.nbytes, regions * n)
    start = np.ones((regions, n, pieces), dtype=bool)
    start[:, 1:, 0] = ~cont
    idx = np.flatnonzero(start.ravel())

    def fill_joined(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
        np.take(s, idx, out=out_s)
        np.take(d, idx, out=out_d)
        np.add.reduceat(ln, idx, out=out_n)

    return idx.size, fill_joined


def _coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Pieces:
    """Sort pieces by destination and merge neighbours contiguous on both sides."""
    order = np.argsort(dst, kind="stable")
    out = Pieces(*merge_neighbours(src[order], dst[order], nbytes[order]))
    for array in out:
        array.setflags(write=False)  # tables are cached and shared between plans
    return out


# -- pairing ----------------------------------------------------------------


def plan(src: Manifest, dst: Manifest) -> Plan:
    """What ``src`` (one source rank) writes into ``dst`` (one destination rank).

    Regions pair by key. A key only one side has is an error when that side
    holds the layer at all (a missing region); otherwise it belongs to another
    pipeline stage and is skipped.
    """
    for side, m in (("source", src), ("destination", dst)):
        expect(m, Manifest, f"plan(src, dst) (the {side})")
    _check_one_sided(src, dst, "source", "destination")
    _check_one_sided(dst, src, "destination", "source")
    buckets: dict[tuple, list[tuple[Region, Region]]] = {}
    pairings: dict[RegionKey, _Pairing] = {}
    pages: dict[str, tuple[int, int]] = {}
    for a in src.regions:
        if a.key not in dst or a.pool == STAGING_POOL:
            continue
        b = dst.region(a.key)
        pairing = _region_pieces(
            _geometry(a), src.tp_rank, src.tp_size, _geometry(b), dst.tp_rank, dst.tp_size
        )
        if isinstance(pairing, str):
            raise PlanError(f"region {a.label}: {pairing}", subject=a.key)
        ratio = (pairing.src_pages, pairing.dst_pages)
        first = pages.setdefault(a.pool, ratio)
        if first != ratio:
            raise PlanError(
                f"region {a.label}: {ratio[0]} source and {ratio[1]} destination pages per slot, "
                f"but other regions of pool {a.pool!r} pair {first[0]} and {first[1]}: a request "
                "names one set of slots per pool",
                subject=a.key,
            )
        pairings[a.key] = pairing
        if pairing.pieces.src.size == 0:
            continue
        bucket = (a.pool, a.slot_nbytes, b.slot_nbytes, id(pairing))
        buckets.setdefault(bucket, []).append((a, b))
    groups = []
    for (pool, s_stride, d_stride, _), pairs in buckets.items():
        pairing = pairings[pairs[0][0].key]
        t = pairing.pieces
        groups.append(
            _Group(
                pool=pool,
                keys=tuple(a.key for a, _ in pairs),
                src_base=np.array([a.addr for a, _ in pairs], dtype=np.uint64),
                dst_base=np.array([b.addr for _, b in pairs], dtype=np.uint64),
                src_stride=s_stride,
                dst_stride=d_stride,
                pairing=pairing,
                src_span=np.uint64(t.src[-1] + t.nbytes[-1] - t.src[0]),
                dst_span=np.uint64(t.dst[-1] + t.nbytes[-1] - t.dst[0]),
            )
        )
    return Plan(src, dst, groups, pairings, pages)


def _check_one_sided(have: Manifest, other: Manifest, side: str, other_side: str) -> None:
    held = {(r.pool, r.layer) for r in other.regions}
    held |= {(k[0], k[2]) for k in other.dropped_keys}
    for r in have.regions:
        if r.key in other or r.pool == STAGING_POOL:
            continue
        if r.key in other.dropped_keys:
            reason = next(d.reason for d in other.dropped if d.key == r.key)
            raise PlanError(
                f"region {r.label} is empty on the {other_side} ({reason}) but holds "
                f"{r.slot_nbytes} bytes per slot on the {side}",
                subject=r.key,
            )
        if (r.pool, r.layer) in held:
            raise PlanError(
                f"region {r.label} exists on the {side} but is missing on the {other_side}, "
                f"which holds other regions of layer {r.layer} in pool {r.pool!r}",
                subject=r.key,
            )


class _Geometry(NamedTuple):
    """The hashable part of a region that decides its pieces."""

    slot_shape: tuple[int, ...]
    itemsize: int
    tp_axis: int | None
    tp_groups: tuple[int, ...] | None
    tp_global: int | None
    axes: tuple[str, ...] | None


def _geometry(r: Region) -> _Geometry:
    return _Geometry(r.slot_shape, r.itemsize, r.tp_axis, r.tp_groups, r.tp_global, r.axes)


MAX_PIECES = 1 << 22
"""Most byte pieces within one slot: the table is built in memory, from sizes a peer claims."""


@lru_cache(maxsize=4096)
def _region_pieces(a: _Geometry, s: int, ts: int, b: _Geometry, d: int, td: int) -> _Pairing | str:
    """What source rank s owes destination rank d within a slot, or why nothing can be.

    Axes are numbered as the source orders them; ``perm[j]`` is the source axis
    that is the destination's axis ``j`` (by name when both sides name them).
    """
    if not a.slot_shape and not b.slot_shape:  # one scalar per slot
        a, b = a._replace(slot_shape=(1,), axes=None), b._replace(slot_shape=(1,), axes=None)
    if a.itemsize != b.itemsize:
        return f"itemsize differs: {a.itemsize} on the source, {b.itemsize} on the destination"
    if len(a.slot_shape) != len(b.slot_shape):
        return f"slot_shape {a.slot_shape} on the source, {b.slot_shape} on the destination"
    ndim = len(a.slot_shape)
    perm, page = tuple(range(ndim)), None
    if a.axes is not None and b.axes is not None:
        if sorted(a.axes) != sorted(b.axes):
            return f"axes {a.axes} on the source, {b.axes} on the destination"
        where = {name: i for i, name in enumerate(a.axes)}
        perm = tuple(where[name] for name in b.axes)
        page = where.get(PAGE_AXIS)
    inv = [0] * ndim  # source axis i is destination axis inv[i]
    for j, i in enumerate(perm):
        inv[i] = j
    bshape = tuple(b.slot_shape[inv[i]] for i in range(ndim))
    tb = None if b.tp_axis is None else perm[b.tp_axis]
    if a.tp_axis is not None and tb is not None and a.tp_axis != tb:
        sides = _axis(a, a.tp_axis), _axis(b, inv[tb])
        return f"sharded along {sides[0]} on the source, {sides[1]} on the destination"
    axis = a.tp_axis if a.tp_axis is not None else (tb if tb is not None else 0)
    ks = kd = 1
    sharded = a.tp_axis is not None or tb is not None
    for i in range(ndim):
        na, nb = a.slot_shape[i], bshape[i]
        if (sharded and i == axis) or na == nb:
            continue
        if i == page and min(na, nb) and max(na, nb) % min(na, nb) == 0:
            ks, kd = max(na // nb, 1), max(nb // na, 1)
            continue
        return (
            f"non-sharded dims differ: slot_shape {a.slot_shape} on the source, "
            f"{b.slot_shape} on the destination (sharded axis {axis}"
            + (f"; {PAGE_AXIS!r} may differ by a whole factor)" if page is not None else ")")
        )
    # The box one page pair spans: the shorter page, the whole of every other axis.
    box = [min(na, nb) for na, nb in zip(a.slot_shape, bshape, strict=True)]
    if not sharded:  # replicated on both sides: one replica writes it all
        runs = [(0, box[axis], 0, 0)] if d % ts == s else []
    else:
        la, lb = _layout(a, axis, ts), _layout(b, inv[axis], td)
        if la.size != lb.size:
            return (
                f"global size of axis {axis} differs: {la.size} on the source "
                f"(local {a.slot_shape[axis]} at TP {ts}), {lb.size} on the destination "
                f"(local {bshape[axis]} at TP {td})"
            )
        problem = _group_mismatch(la, lb)
        if problem:
            return problem
        runs = _owned_runs(la, s, lb.segments(d), d)
    sa = c_strides(a.slot_shape, a.itemsize)
    db = c_strides(b.slot_shape, b.itemsize)
    sb = [db[inv[i]] for i in range(ndim)]
    cuts = []
    for _, length, s_at, d_at in runs:
        box[axis] = length
        dims = [(box[i], sa[i], sb[i]) for i in perm]  # destination order, outer first
        cuts.append((_collapse(dims, a.itemsize), s_at * sa[axis], d_at * sb[axis]))
    # Bounded before anything is allocated; coverage walks every destination page.
    count = sum(math.prod(n for n, _, _ in grid) for (_, grid), _, _ in cuts) * kd
    if count > MAX_PIECES:
        return (
            f"one slot would need {count} pieces (more than {MAX_PIECES}): the sharded axis "
            f"{axis} of slot_shape {a.slot_shape} lies under too many rows, or the layouts "
            "transpose too finely; shard an outer axis"
        )
    pieces = _coalesce(*_enumerate(cuts)) if cuts else _NO_PIECES
    s_shift = box[page] * sa[page] if page is not None and ks > 1 else 0
    d_shift = box[page] * sb[page] if page is not None and kd > 1 else 0
    return _Pairing(
        pieces,
        ks,
        kd,
        s_shift,
        d_shift,
        _note(a, b, perm, ks, kd),
    )


def _axis(g: _Geometry, i: int) -> str:
    return f"axis {i}" + (f" ({g.axes[i]!r})" if g.axes is not None else "")


Dims = list[tuple[int, int, int]]


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


def _enumerate(
    cuts: list[tuple[tuple[int, Dims], int, int]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _note(a: _Geometry, b: _Geometry, perm: tuple[int, ...], ks: int, kd: int) -> str:
    parts = []
    if perm != tuple(range(len(perm))):
        parts.append(f"axes {a.axes} on the source, {b.axes} on the destination")
    if ks > 1:
        parts.append(f"a source slot holds {ks} destination pages")
    if kd > 1:
        parts.append(f"a destination slot holds {kd} source pages")
    return "; ".join(parts)


def _layout(g: _Geometry, axis: int, tp_size: int) -> AxisLayout:
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


def _owned_runs(
    src_layout: AxisLayout, s: int, wanted: tuple[Segment, ...], d: int
) -> list[tuple[int, int, int, int]]:
    """(global start, length, src local, dst local) runs of the axis that rank s writes to d.

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


# -- coverage ---------------------------------------------------------------


class Coverage(NamedTuple):
    """Which sources a destination needs, with their plans, proven to write each byte once."""

    sources: tuple[int, ...]  # indices into the ``srcs`` given to ``coverage``
    plans: dict[int, Plan]


def _first_not_once(
    starts: np.ndarray, nbytes: np.ndarray, size: int
) -> tuple[int, int, int] | None:
    """The first run of [0, size) not covered exactly once: (start, end, times), or None.

    A sweep over the pieces' edges: it costs what the pieces cost, not the slot size.
    """
    pos = np.concatenate([starts, starts + nbytes, [0, size]])
    delta = np.concatenate(
        [np.ones(starts.size, np.int64), -np.ones(starts.size, np.int64), [0, 0]]
    )
    order = np.argsort(pos, kind="stable")
    pos, delta = pos[order], delta[order]
    edges, first = np.unique(pos, return_index=True)
    level = np.cumsum(np.add.reduceat(delta, first))[:-1]  # over [edges[k], edges[k+1])
    wrong = np.flatnonzero((level != 1) & (edges[:-1] < size))
    if not wrong.size:
        return None
    k = int(wrong[0])
    n = int(level[k])
    change = np.flatnonzero(level[k:] != n)
    end = int(edges[k + int(change[0])]) if change.size else size
    return int(edges[k]), min(end, size), n


def coverage(srcs: Sequence[Manifest], dst: Manifest) -> Coverage:
    """Plan every source for ``dst`` and prove each destination byte is written exactly once.

    ``srcs`` are all the source ranks (every TP rank of every pipeline stage).
    Raises ``PlanError`` naming the region and byte range that would be left
    unwritten or written twice.
    """
    if (
        not isinstance(srcs, Sequence)
        or not all(isinstance(m, Manifest) for m in srcs)
        or not isinstance(dst, Manifest)
    ):
        raise ArgumentError(
            "coverage(srcs, dst) takes a sequence of source Manifests and one Manifest"
        )
    plans = {i: plan(m, dst) for i, m in enumerate(srcs)}
    for r in dst.regions:
        if r.pool == STAGING_POOL:
            continue
        size = r.slot_nbytes
        writers = [i for i, p in plans.items() if p.pieces(r.key).src.size]
        starts, lengths = [], []
        for i in writers:
            pairing = plans[i]._pairings[r.key]
            t = pairing.pieces
            pages = np.arange(pairing.dst_pages, dtype=np.uint64) * np.uint64(pairing.dst_shift)
            starts.append((pages[:, None] + t.dst[None, :]).ravel())
            lengths.append(np.tile(t.nbytes, pairing.dst_pages))
        bad = _first_not_once(
            np.concatenate(starts or [_EMPTY]).astype(np.int64),
            np.concatenate(lengths or [_EMPTY]).astype(np.int64),
            size,
        )
        if bad is not None:
            first, end, n = bad
            what = "is written by no source" if n == 0 else f"is written {n} times"
            raise PlanError(
                f"region {key_label(r.key)}: bytes [{first}, {end}) of each slot {what} "
                f"(sources writing this region: {writers or 'none'})",
                subject=r.key,
            )
    used = tuple(i for i, p in plans.items() if not p.empty)
    return Coverage(used, {i: plans[i] for i in used})
