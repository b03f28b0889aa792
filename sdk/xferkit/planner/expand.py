"""Per-request expansion: a request's slots into page pairs, page pairs into descriptors.

This is the per-request cost. A request is checked whole (known pool, indices
in range, no destination slot twice, lengths matching the pool's pages) before
anything is produced; its page pairs are sorted by destination, and each
region group's piece table is broadcast over them, coalescing pages that
continue each other on both sides, in numpy, with no per-slot loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..descriptors import Descriptors
from ..errors import PlanError
from ..manifest import RegionKey
from .pieces import Alignment, Pieces

if TYPE_CHECKING:
    from ..manifest import Manifest


class RegionGroup(NamedTuple):
    """Regions of one pool sharing slot sizes and an alignment: expanded in one broadcast."""

    pool: str
    keys: tuple[RegionKey, ...]
    src_base: np.ndarray  # (R,) uint64
    dst_base: np.ndarray
    src_stride: int
    dst_stride: int
    alignment: Alignment
    src_span: np.uint64  # from a page's first piece (in destination order) to its last's end
    dst_span: np.uint64

    @property
    def pieces(self) -> Pieces:
        return self.alignment.pieces


Layers = frozenset[int] | None
"""The layers a layer-wise chunk covers (None: every layer)."""


def of_layers(g: RegionGroup, layers: frozenset[int]) -> RegionGroup | None:
    """``g`` with only its regions of ``layers`` (None when it holds none of them)."""
    keep = np.fromiter((k[2] in layers for k in g.keys), dtype=bool, count=len(g.keys))
    if keep.all():
        return g
    if not keep.any():
        return None
    idx = np.flatnonzero(keep)
    keys = tuple(g.keys[i] for i in idx)
    return g._replace(keys=keys, src_base=g.src_base[idx], dst_base=g.dst_base[idx])


class PagePairs(NamedTuple):
    """A request's page pairs for one pool, sorted by destination: slot indices, the page
    within each slot (None when every slot is one page) and which pair of the request, in the
    caller's order, each is (None: that order already). Both sides of a Session know the
    caller's order, not the other's slots."""

    src: np.ndarray
    dst: np.ndarray
    src_page: np.ndarray | None
    dst_page: np.ndarray | None
    order: np.ndarray | None

    def offsets(self, g: RegionGroup) -> tuple[np.ndarray, np.ndarray]:
        """Byte offset of each pair's page within ``g``'s regions, on both sides."""
        s = self.src * np.uint64(g.src_stride)
        d = self.dst * np.uint64(g.dst_stride)
        if self.src_page is not None:
            s += self.src_page * np.uint64(g.alignment.src_shift)
        if self.dst_page is not None:
            d += self.dst_page * np.uint64(g.alignment.dst_shift)
        return s, d

    def in_request_order(self) -> PagePairs:
        """These pairs in the caller's order rather than the destination's."""
        if self.order is None:
            return self
        back = np.empty_like(self.order)
        back[self.order] = np.arange(self.order.size)
        return PagePairs(
            self.src[back],
            self.dst[back],
            None if self.src_page is None else self.src_page[back],
            None if self.dst_page is None else self.dst_page[back],
            None,
        )


class Slots(NamedTuple):
    """What a request for one destination rank is checked against."""

    known: frozenset[str]  # pools a request may name
    src: Mapping[str, int]  # slot count per pool, each side
    dst: Mapping[str, int]
    pages: Mapping[str, tuple[int, int]]  # (source, destination) pages per slot of a pool


def page_pairs(pool: str, pair: tuple[object, object], slots: Slots) -> PagePairs:
    """One pool's ``(src_slot_indices, dst_slot_indices)``, checked, as page pairs."""
    if pool not in slots.known:
        known = sorted(slots.known)
        raise PlanError(f"unknown pool {pool!r}; the destination has {known}", subject=pool)
    try:
        src_raw, dst_raw = pair
    except (TypeError, ValueError):
        raise PlanError(
            f"pool {pool!r}: expected (src_slot_indices, dst_slot_indices)", subject=pool
        ) from None
    src = _indices(src_raw, pool, "source", slots.src.get(pool))
    dst = _indices(dst_raw, pool, "destination", slots.dst.get(pool))
    pages = slots.pages.get(pool)
    if pages is None:  # nothing of the pool moves here: its slots pair with nothing
        return PagePairs(src[:0], dst[:0], None, None, None)
    ks, kd = pages
    if ks == kd == 1:
        if src.shape != dst.shape:
            raise PlanError(
                f"pool {pool!r}: {src.size} source slots but {dst.size} destination slots",
                subject=pool,
            )
        if dst.size <= 1:  # one slot (a decode step's page): nothing to order or join
            return PagePairs(src, dst, None, None, None)
    order = np.argsort(dst, kind="stable")
    ordered = dst[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if same.size:
        raise PlanError(
            f"pool {pool!r}: destination slot {int(ordered[same[0]])} is requested twice",
            subject=pool,
        )
    if ks == kd == 1:
        return PagePairs(src[order], ordered, None, None, order)
    return _paged_pairs(pool, src, dst, ks, kd)


def _paged_pairs(pool: str, src: np.ndarray, dst: np.ndarray, ks: int, kd: int) -> PagePairs:
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
    return PagePairs(
        s_slot[order],
        d_slot[order],
        s_page[order] if ks > 1 else None,
        d_page[order] if kd > 1 else None,
        order,
    )


def _indices(raw: object, pool: str, side: str, count: int | None) -> np.ndarray:
    """Validated slot indices; ``count`` is None when that side holds no region of the pool."""
    try:
        arr = np.asarray(raw)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, objects that raise
        raise PlanError(
            f"pool {pool!r}: {side} slot indices must be a 1-D integer array: {exc}", subject=pool
        ) from None
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


def expand_groups(
    pairs: Mapping[str, PagePairs],
    groups: Iterable[RegionGroup],
    origin: tuple[Manifest, Manifest],
) -> Descriptors:
    """Sealed descriptors of ``groups`` for checked page pairs (pools absent move nothing)."""
    chosen = [(g, pairs[g.pool]) for g in groups if g.pool in pairs]
    if not chosen:  # a chunk every group of which is staged: nothing goes direct
        return Descriptors.sealed(0, *origin)
    if all(_one_copy(g, p) for g, p in chosen):
        return _one_page_each(chosen, origin)
    parts = [_expand_group(g, p) for g, p in chosen]
    out = Descriptors.sealed(sum(count for count, _ in parts), *origin)
    at = 0
    with out.filling() as (s, d, n):
        for count, fill in parts:
            fill(s[at : at + count], d[at : at + count], n[at : at + count])
            at += count
    return out


def _one_copy(g: RegionGroup, pairs: PagePairs) -> bool:
    """One page pair whose pages are whole slots, one piece each: a copy per region."""
    return (
        pairs.src.size == 1
        and pairs.src_page is None
        and pairs.dst_page is None
        and g.pieces.src.size == 1
    )


def _one_page_each(
    chosen: list[tuple[RegionGroup, PagePairs]], origin: tuple[Manifest, Manifest]
) -> Descriptors:
    """``_expand_group``'s result where every group moves one page in one piece (a decode
    step's page, a one-page request): its region bases plus a scalar offset, without the
    general path's per-call arrays (it costs a third as much: the common small request)."""
    count = sum(g.src_base.size for g, _ in chosen)
    whole = np.empty(3 * count, dtype=np.uint64)
    at = 0
    for g, p in chosen:
        end, table = at + g.src_base.size, g.pieces
        s = int(p.src[0]) * g.src_stride + int(table.src[0])
        d = int(p.dst[0]) * g.dst_stride + int(table.dst[0])
        np.add(g.src_base, np.uint64(s), out=whole[at:end])
        np.add(g.dst_base, np.uint64(d), out=whole[count + at : count + end])
        whole[2 * count + at : 2 * count + end] = table.nbytes[0]
        at = end
    return Descriptors.sealed_copy(whole, *origin)


_FIRST = np.zeros(1, dtype=np.intp)
_FIRST.setflags(write=False)
_NO_RUNS = np.zeros(0, dtype=bool)
_NO_RUNS.setflags(write=False)

Fill = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
"""Writes a group's descriptors into (src, dst, nbytes) slices of the request's final arrays."""


def _expand_group(g: RegionGroup, pairs: PagePairs) -> tuple[int, Fill]:
    """(descriptor count, filler): the final arrays are allocated once, sealed, then filled."""
    n, regions = pairs.src.size, g.src_base.size
    if n == 0:
        return 0, lambda *out: None
    src, dst = pairs.offsets(g)
    table = g.pieces
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
