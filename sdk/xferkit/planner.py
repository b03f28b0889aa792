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

from .descriptors import Descriptors
from .errors import PlanError
from .manifest import STAGING_POOL, Manifest, Region, RegionKey, key_label
from .sharding import AxisLayout, Segment, axis_layout


class Pieces(NamedTuple):
    """Byte pieces within one slot, sorted by destination offset, already coalesced."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray


class _Group(NamedTuple):
    """Regions of one pool sharing slot sizes and a piece table: expanded in one broadcast."""

    pool: str
    keys: tuple[RegionKey, ...]
    src_base: np.ndarray  # (R,) uint64
    dst_base: np.ndarray
    src_stride: int
    dst_stride: int
    pieces: Pieces
    whole: bool  # one piece spanning the whole slot on both sides
    joins: bool  # the last piece of a slot can continue into the next slot's first


class Plan:
    """What source rank ``src_rank`` writes into destination rank ``dst_rank``.

    Compute once per manifest pair with ``plan(src, dst)``; call ``expand`` per request.
    """

    __slots__ = (
        "_groups",
        "_known",
        "_origin",
        "_pieces",
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
        pieces: dict[RegionKey, Pieces],
    ) -> None:
        self.src_rank = src.tp_rank
        self.dst_rank = dst.tp_rank
        self.src_slots = dict(src.pools)
        self.dst_slots = dict(dst.pools)
        # A request is one destination rank's: it may name any pool that rank has, even
        # one whose regions were all dropped or that this source's pipeline stage lacks.
        self._known = (set(dst.pools) | {k[0] for k in dst.dropped_keys}) - {STAGING_POOL}
        self._groups = groups
        self._pieces = pieces
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

    def pieces(self, key: RegionKey) -> Pieces:
        """The copies within one slot of ``key`` (empty when this source writes none of it)."""
        return self._pieces.get(key) or _NO_PIECES

    def slot_bytes(self, pool: str) -> int:
        """Bytes this plan moves per slot of ``pool``."""
        return sum(len(g.keys) * int(g.pieces.nbytes.sum()) for g in self._groups if g.pool == pool)

    def expand(self, request: Mapping[str, tuple[object, object]]) -> Descriptors:
        """Descriptors for a request: ``request[pool] = (src_slot_indices, dst_slot_indices)``.

        Pools of the plan absent from ``request`` are not transferred. Every input
        is checked before anything is produced.
        """
        if not isinstance(request, Mapping):
            raise PlanError(f"a request maps pool -> (src_slots, dst_slots), not {request!r}")
        requests = {pool: self._slot_runs(pool, pair) for pool, pair in request.items()}
        return self._expand(requests, self._groups)

    def _expand(
        self,
        requests: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        groups: list[_Group],
    ) -> Descriptors:
        """Descriptors of ``groups`` for validated slot runs (``staging`` expands a subset)."""
        parts = [_expand_group(g, *requests[g.pool]) for g in groups if g.pool in requests]
        out = Descriptors.sealed(sum(count for count, _ in parts), *self._origin)
        at = 0
        with out.filling() as (s, d, n):
            for count, fill in parts:
                fill(s[at : at + count], d[at : at + count], n[at : at + count])
                at += count
        return out

    def _slot_runs(
        self, pool: str, pair: tuple[object, object]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        if src.shape != dst.shape:
            raise PlanError(
                f"pool {pool!r}: {src.size} source slots but {dst.size} destination slots",
                subject=pool,
            )
        if dst.size <= 1:  # one slot (a decode step's page): nothing to order or join
            return src, dst, _NO_RUNS
        order = np.argsort(dst, kind="stable")
        src, dst = src[order], dst[order]
        same = np.flatnonzero(dst[1:] == dst[:-1])
        if same.size:
            raise PlanError(
                f"pool {pool!r}: destination slot {int(dst[same[0]])} is requested twice",
                subject=pool,
            )
        # A slot continues the previous run when both indices advance by one.
        cont = (src[1:] == src[:-1] + 1) & (dst[1:] == dst[:-1] + 1)
        return src, dst, cont


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


def _expand_group(
    g: _Group, src: np.ndarray, dst: np.ndarray, cont: np.ndarray
) -> tuple[int, Fill]:
    """(descriptor count, filler): the final arrays are allocated once, sealed, then filled."""
    n, regions = src.size, g.src_base.size
    if n == 0:
        return 0, lambda *out: None
    if g.whole:
        # Runs of consecutive slots become one descriptor per region.
        if n == 1:
            starts, lengths = _FIRST, np.full(1, g.src_stride, dtype=np.uint64)
        else:
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            lengths = np.diff(np.append(starts, n)).astype(np.uint64) * np.uint64(g.src_stride)
        s_off = src[starts] * np.uint64(g.src_stride) + g.pieces.src[0]
        d_off = dst[starts] * np.uint64(g.dst_stride) + g.pieces.dst[0]

        def fill_runs(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
            shape = (regions, starts.size)
            np.add(g.src_base[:, None], s_off[None, :], out=out_s.reshape(shape))
            np.add(g.dst_base[:, None], d_off[None, :], out=out_d.reshape(shape))
            out_n.reshape(shape)[:] = lengths[None, :]

        return regions * starts.size, fill_runs
    # Offsets within a region first (n*P), then one pass adds each region's base.
    pieces = g.pieces.src.size
    s_off = ((src * np.uint64(g.src_stride))[:, None] + g.pieces.src[None, :]).ravel()
    d_off = ((dst * np.uint64(g.dst_stride))[:, None] + g.pieces.dst[None, :]).ravel()
    if not (g.joins and cont.any()):

        def fill_pieces(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
            shape = (regions, n * pieces)
            np.add(g.src_base[:, None], s_off[None, :], out=out_s.reshape(shape))
            np.add(g.dst_base[:, None], d_off[None, :], out=out_d.reshape(shape))
            out_n.reshape(regions * n, pieces)[:] = g.pieces.nbytes[None, :]

        return regions * n * pieces, fill_pieces
    # The last piece of slot i joins the first piece of slot i+1 where both advance by one.
    s = (g.src_base[:, None] + s_off[None, :]).ravel()
    d = (g.dst_base[:, None] + d_off[None, :]).ravel()
    ln = np.tile(g.pieces.nbytes, regions * n)
    start = np.ones((regions, n, pieces), dtype=bool)
    start[:, 1:, 0] = ~cont
    idx = np.flatnonzero(start.ravel())

    def fill_joined(out_s: np.ndarray, out_d: np.ndarray, out_n: np.ndarray) -> None:
        np.take(s, idx, out=out_s)
        np.take(d, idx, out=out_d)
        np.add.reduceat(ln, idx, out=out_n)

    return idx.size, fill_joined


def _compress(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, start: np.ndarray
) -> Descriptors:
    """Merge every piece not flagged as a start into the piece before it."""
    idx = np.flatnonzero(start)
    return Descriptors(src[idx], dst[idx], np.add.reduceat(nbytes, idx).astype(np.uint64))


def _coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Pieces:
    """Sort pieces by destination and merge neighbours contiguous on both sides."""
    order = np.argsort(dst, kind="stable")
    src, dst, nbytes = src[order], dst[order], nbytes[order]
    start = np.ones(src.size, dtype=bool)
    start[1:] = (src[:-1] + nbytes[:-1] != src[1:]) | (dst[:-1] + nbytes[:-1] != dst[1:])
    out = _compress(src, dst, nbytes, start)
    for array in (out.src, out.dst, out.nbytes):
        array.setflags(write=False)  # tables are cached and shared between plans
    return Pieces(out.src, out.dst, out.nbytes)


# -- pairing ----------------------------------------------------------------


def plan(src: Manifest, dst: Manifest) -> Plan:
    """What ``src`` (one source rank) writes into ``dst`` (one destination rank).

    Regions pair by key. A key only one side has is an error when that side
    holds the layer at all (a missing region); otherwise it belongs to another
    pipeline stage and is skipped.
    """
    for side, m in (("source", src), ("destination", dst)):
        if not isinstance(m, Manifest):
            raise PlanError(f"plan(src, dst): the {side} must be a Manifest, not {m!r}")
    _check_one_sided(src, dst, "source", "destination")
    _check_one_sided(dst, src, "destination", "source")
    buckets: dict[tuple, list[tuple[Region, Region]]] = {}
    pieces_by_key: dict[RegionKey, Pieces] = {}
    for a in src.regions:
        if a.key not in dst or a.pool == STAGING_POOL:
            continue
        b = dst.region(a.key)
        table = _region_pieces(
            _geometry(a), src.tp_rank, src.tp_size, _geometry(b), dst.tp_rank, dst.tp_size
        )
        if isinstance(table, str):
            raise PlanError(f"region {a.label}: {table}", subject=a.key)
        if table.src.size == 0:
            continue
        pieces_by_key[a.key] = table
        bucket = (a.pool, a.slot_nbytes, b.slot_nbytes, id(table))
        buckets.setdefault(bucket, []).append((a, b))
    groups = []
    for (pool, s_stride, d_stride, _), pairs in buckets.items():
        table = pieces_by_key[pairs[0][0].key]
        joins = bool(
            table.src[0] == 0
            and table.dst[0] == 0
            and table.src[-1] + table.nbytes[-1] == s_stride
            and table.dst[-1] + table.nbytes[-1] == d_stride
        )
        groups.append(
            _Group(
                pool=pool,
                keys=tuple(a.key for a, _ in pairs),
                src_base=np.array([a.addr for a, _ in pairs], dtype=np.uint64),
                dst_base=np.array([b.addr for _, b in pairs], dtype=np.uint64),
                src_stride=s_stride,
                dst_stride=d_stride,
                pieces=table,
                whole=joins and table.src.size == 1,
                joins=joins,
            )
        )
    return Plan(src, dst, groups, pieces_by_key)


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


def _geometry(r: Region) -> _Geometry:
    return _Geometry(r.slot_shape, r.itemsize, r.tp_axis, r.tp_groups, r.tp_global)


MAX_PIECES = 1 << 22
"""Most byte pieces within one slot: the table is built in memory, from sizes a peer claims."""


@lru_cache(maxsize=4096)
def _region_pieces(a: _Geometry, s: int, ts: int, b: _Geometry, d: int, td: int) -> Pieces | str:
    """Pieces within one slot that source rank s owes destination rank d, or why none can be."""
    if not a.slot_shape and not b.slot_shape:  # one scalar per slot
        a, b = a._replace(slot_shape=(1,)), b._replace(slot_shape=(1,))
    if a.itemsize != b.itemsize:
        return f"itemsize differs: {a.itemsize} on the source, {b.itemsize} on the destination"
    if len(a.slot_shape) != len(b.slot_shape):
        return f"slot_shape {a.slot_shape} on the source, {b.slot_shape} on the destination"
    if a.tp_axis is not None and b.tp_axis is not None and a.tp_axis != b.tp_axis:
        return f"sharded along axis {a.tp_axis} on the source, {b.tp_axis} on the destination"
    axis = a.tp_axis if a.tp_axis is not None else (b.tp_axis or 0)
    other = [i for i in range(len(a.slot_shape)) if i != axis]
    if any(a.slot_shape[i] != b.slot_shape[i] for i in other):
        return (
            f"non-sharded dims differ: slot_shape {a.slot_shape} on the source, "
            f"{b.slot_shape} on the destination (sharded axis {axis})"
        )
    la, lb = _layout(a, axis, ts), _layout(b, axis, td)
    if la.size != lb.size:
        return (
            f"global size of axis {axis} differs: {la.size} on the source "
            f"(local {a.slot_shape[axis]} at TP {ts}), {lb.size} on the destination "
            f"(local {b.slot_shape[axis]} at TP {td})"
        )
    problem = _group_mismatch(la, lb)
    if problem:
        return problem
    runs = _owned_runs(la, s, lb.segments(d), d)
    pieces = math.prod(a.slot_shape[:axis]) * len(runs)
    if pieces > MAX_PIECES:
        return (
            f"one slot would need {pieces} pieces (more than {MAX_PIECES}): the sharded axis "
            f"{axis} of slot_shape {a.slot_shape} lies under too many rows; shard an outer axis"
        )
    return _runs_to_bytes(runs, a.slot_shape, axis, a.itemsize, b.slot_shape[axis])


def _layout(g: _Geometry, axis: int, tp_size: int) -> AxisLayout:
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


def _runs_to_bytes(
    runs: list[tuple[int, int, int, int]],
    shape: tuple[int, ...],
    axis: int,
    itemsize: int,
    dst_local: int,
) -> Pieces:
    """Repeat each run once per row outside the sharded axis and convert to bytes."""
    if not runs:
        return _NO_PIECES
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :]) * itemsize
    src_row, dst_row = shape[axis] * inner, dst_local * inner
    r = np.array(runs, dtype=np.uint64)
    rows = np.arange(outer, dtype=np.uint64)[:, None]
    src = rows * np.uint64(src_row) + r[None, :, 2] * np.uint64(inner)
    dst = rows * np.uint64(dst_row) + r[None, :, 3] * np.uint64(inner)
    nbytes = np.broadcast_to(r[None, :, 1] * np.uint64(inner), src.shape)
    return _coalesce(src.ravel(), dst.ravel(), np.ascontiguousarray(nbytes).ravel())


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
        raise PlanError("coverage(srcs, dst) takes a sequence of source Manifests and one Manifest")
    plans = {i: plan(m, dst) for i, m in enumerate(srcs)}
    for r in dst.regions:
        if r.pool == STAGING_POOL:
            continue
        size = r.slot_nbytes
        writers = [i for i, p in plans.items() if p.pieces(r.key).src.size]
        tables = [plans[i].pieces(r.key) for i in writers]
        bad = _first_not_once(
            np.concatenate([t.dst for t in tables] or [_EMPTY]).astype(np.int64),
            np.concatenate([t.nbytes for t in tables] or [_EMPTY]).astype(np.int64),
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
