"""Hypothesis strategies: random model layouts, requests and manifests.

Engines and plugin authors reuse them to drive their own property tests
against the reference model (``xferkit.testing.Reference``). Importing this
module needs ``hypothesis`` (a test dependency, not a runtime one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import msgspec
import numpy as np
from hypothesis import strategies as st

from ..manifest import PAGE_AXIS, Region
from .reference import Reference, RegionSpec

POOLS = ("kv", "state", "aux")
NAMES = ("k", "v", "conv", "temporal")
AXIS_NAMES = ("head", "dim", "x")
"""Names of the axes other than ``PAGE_AXIS`` that ``region_specs(views=True)`` draws."""

RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (3, 1), (4, 1))
"""(source, destination) pages a slot holds of the smaller page: one side 1, the other 1..4."""

# Pairs worth meeting often: gathers, scatters and ratios that are not whole numbers.
INTERESTING_TP = ((1, 1), (2, 2), (3, 2), (2, 3), (4, 8), (8, 4), (1, 8), (8, 1), (4, 6), (6, 4))


class Layout(NamedTuple):
    """A model (global region specs) and how both sides split it over TP and PP."""

    specs: tuple[RegionSpec, ...]
    src_tp: int
    dst_tp: int
    src_pp: int
    dst_pp: int
    src_slots: Mapping[str, int]
    dst_slots: Mapping[str, int]
    pages: Mapping[str, tuple[int, int]] = MappingProxyType({})
    """Per pool (source, destination) pages a slot holds of the smaller page; absent: (1, 1)."""

    def reference(self, seed: int = 0) -> Reference:
        return Reference(
            self.specs,
            src_tp=self.src_tp,
            dst_tp=self.dst_tp,
            src_slots=self.src_slots,
            dst_slots=self.dst_slots,
            src_pp=self.src_pp,
            dst_pp=self.dst_pp,
            seed=seed,
        )


def tp_pairs(max_tp: int = 8) -> st.SearchStrategy[tuple[int, int]]:
    """(source TP, destination TP), each in 1..max_tp, favouring non-divisible pairs."""
    sizes = st.integers(1, max_tp)
    picked = [p for p in INTERESTING_TP if max(p) <= max_tp]
    return st.one_of(st.sampled_from(picked), st.tuples(sizes, sizes))


@st.composite
def region_specs(
    draw: st.DrawFn,
    *,
    pool: str,
    name: str,
    layer: int,
    part: int,
    tp_sizes: Sequence[int],
    empty: bool | None = None,
    sharded: bool | None = None,
    views: bool = False,
    token: bool | None = None,
    pages: tuple[int, int] = (1, 1),
) -> RegionSpec:
    """One region's global slot shape and sharding, valid for every TP size in ``tp_sizes``.

    The sharded axis is sometimes not divisible by a TP size (ranks then hold
    overlapping shares, as GQA does with more ranks than KV heads), sometimes
    split into shard groups divisible by every TP size. ``empty`` forces (True)
    or forbids (False) a zero dimension, ``sharded`` a sharded axis; None lets
    hypothesis choose.

    ``views`` names the axes (now and then not) and lays each side out in its
    own random order; ``token`` forces (True) or forbids (False) an unsharded
    ``PAGE_AXIS`` of 1..3 tokens (None: hypothesis chooses), whose slots hold
    ``pages`` = (source, destination) model pages (needs ``token``).
    """
    itemsize = draw(st.sampled_from((1, 2, 4)))
    ndim = draw(st.integers(1 if sharded else 0, 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    tp_axis = None
    groups = None
    if sharded or (sharded is None and ndim and draw(st.booleans())):
        tp_axis = draw(st.integers(0, ndim - 1))
        lcm = math.lcm(*tp_sizes)
        mode = draw(st.sampled_from(("divisible", "any", "groups")))
        if mode == "groups" and lcm <= 12:
            groups = tuple(lcm * draw(st.integers(1, 2)) for _ in range(draw(st.integers(2, 3))))
            shape[tp_axis] = sum(groups)
        elif mode == "divisible" and lcm <= 24:
            shape[tp_axis] = lcm * draw(st.integers(1, 2))
        else:
            shape[tp_axis] = draw(st.integers(1, 2 * max(tp_sizes) + 1))
    if empty is None:
        empty = ndim > 0 and draw(st.integers(0, 5)) == 5
    if empty:
        # A zero on the sharded axis would contradict the shard groups.
        zeroable = [i for i in range(ndim) if groups is None or i != tp_axis]
        if not zeroable:
            shape.append(0)
            ndim += 1
            zeroable = [ndim - 1]
        shape[draw(st.sampled_from(zeroable))] = 0
    spec = RegionSpec(
        pool=pool,
        name=name,
        layer=layer,
        part=part,
        shape=tuple(shape),
        itemsize=itemsize,
        tp_axis=tp_axis,
        tp_groups=groups,
    )
    return draw(_views(spec, token, pages)) if views else spec


@st.composite
def _views(
    draw: st.DrawFn, spec: RegionSpec, token: bool | None, pages: tuple[int, int]
) -> RegionSpec:
    """``spec`` with named axes, maybe a token axis inserted, and each side's own order."""
    shape, tp_axis = list(spec.shape), spec.tp_axis
    if token is None:
        token = draw(st.booleans())
    if not token and pages == (1, 1) and draw(st.integers(0, 3)) == 0:
        return spec  # unnamed: both sides pair positionally
    names = list(draw(st.permutations(AXIS_NAMES))[: len(shape)])
    if token:
        at = draw(st.integers(0, len(shape)))
        shape.insert(at, draw(st.integers(1, 3)))
        names.insert(at, PAGE_AXIS)
        if tp_axis is not None and tp_axis >= at:
            tp_axis += 1
    ndim = len(shape)
    return msgspec.structs.replace(
        spec,
        shape=tuple(shape),
        tp_axis=tp_axis,
        axes=tuple(names),
        src_order=tuple(draw(st.permutations(range(ndim)))),
        dst_order=tuple(draw(st.permutations(range(ndim)))),
        src_pages=pages[0],
        dst_pages=pages[1],
    )


_keys = st.tuples(
    st.sampled_from(POOLS), st.sampled_from(NAMES), st.integers(0, 3), st.integers(0, 2)
)


@st.composite
def layouts(
    draw: st.DrawFn,
    *,
    max_tp: int = 8,
    max_pp: int = 3,
    max_regions: int = 6,
    max_slots: int = 5,
    tp: st.SearchStrategy[tuple[int, int]] | None = None,
    empty: bool | None = None,
    sharded: bool | None = None,
    views: bool = False,
) -> Layout:
    """A random model split over random TP sizes and pipeline stages on both sides.

    ``tp`` draws the (source, destination) TP sizes (default ``tp_pairs(max_tp)``);
    ``empty`` and ``sharded`` are passed to ``region_specs`` for every region.
    ``views`` names axes and orders each side its own way, and gives each pool a
    page ratio (``Layout.pages``, from ``RATIOS``): in a pool whose ratio is not
    (1, 1) every region has a token axis; the side of the smaller page gets up
    to k times ``max_slots`` slots when the other's slot holds k of its pages.
    """
    src_tp, dst_tp = draw(tp if tp is not None else tp_pairs(max_tp))
    keys = draw(st.lists(_keys, min_size=1, max_size=max_regions, unique=True))
    pools = sorted({k[0] for k in keys})
    ratios = st.just(RATIOS[0]) | st.sampled_from(RATIOS[1:])  # half the pools 1:1
    pages = {p: draw(ratios) for p in pools} if views else {}
    specs = tuple(
        draw(
            region_specs(
                pool=pool,
                name=name,
                layer=layer,
                part=part,
                tp_sizes=(src_tp, dst_tp),
                empty=empty,
                sharded=sharded,
                views=views,
                token=None if pages.get(pool, (1, 1)) == (1, 1) else True,
                pages=pages.get(pool, (1, 1)),
            )
        )
        for pool, name, layer, part in keys
    )
    return Layout(
        specs=specs,
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_pp=draw(st.integers(1, max_pp)),
        dst_pp=draw(st.integers(1, max_pp)),
        src_slots={p: draw(st.integers(1, max_slots * pages.get(p, (1, 1))[1])) for p in pools},
        dst_slots={p: draw(st.integers(1, max_slots * pages.get(p, (1, 1))[0])) for p in pools},
        pages=pages,
    )


@st.composite
def slot_pairs(
    draw: st.DrawFn, src_slots: int, dst_slots: int, src_pages: int = 1, dst_pages: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(source slots, destination slots) for one pool: distinct destinations, sources may repeat
    (not where pages differ).

    Runs of consecutive slots on both sides are frequent (they must coalesce);
    the pairs come in a random order (expand must not care). With
    ``dst_pages = k > 1`` (a destination slot holds k source slots' pages) the
    i-th source slot goes to destination ``i // k``, and the last destination
    slot may be filled only in part; ``src_pages = k > 1`` the other way round.
    """
    n = draw(st.integers(1, dst_slots + 1)) % (dst_slots + 1)  # now and then none at all
    if draw(st.booleans()):
        start = draw(st.integers(0, dst_slots - n))
        dst = list(range(start, start + n))
    else:
        dst = draw(st.permutations(range(dst_slots)))[:n]
    # Fine slots per coarse slot of each side (the pages a slot holds of the smaller page).
    ks, kd = max(src_pages // dst_pages, 1), max(dst_pages // src_pages, 1)
    # Several sources a destination: the last one maybe in part; else as many as dst needs.
    m = draw(st.integers((n - 1) * kd + 1, n * kd)) if kd > 1 and n else -(-n // ks)
    if (ks > 1 or kd > 1) and m > src_slots:  # distinct sources (below): as many as there are
        m = src_slots
        n = -(-m // kd) if kd > 1 else min(n, m * ks)
        dst = dst[:n]
    if m <= src_slots and draw(st.booleans()):
        start = draw(st.integers(0, src_slots - m))
        src = list(range(start, start + m))
    elif ks == kd == 1:
        src = draw(st.lists(st.integers(0, src_slots - 1), min_size=m, max_size=m))
    else:
        # Distinct: a page copied twice into one slot could merge with its own other half
        # (descriptors minimal only up to that), and no engine repeats a page it splits.
        src = draw(st.permutations(range(src_slots)))[:m]
    # Shuffle whole groups (one coarse slot and its fine ones); a part-filled group stays last.
    groups = max(-(-m // kd), -(-n // ks))
    full = groups - (m % kd != 0 or n % ks != 0)
    order = [*draw(st.permutations(range(full))), *range(full, groups)]
    src = [src[j] for g in order for j in range(g * kd, min((g + 1) * kd, m))]
    dst = [dst[j] for g in order for j in range(g * ks, min((g + 1) * ks, n))]
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@st.composite
def slot_requests(
    draw: st.DrawFn,
    src_slots: Mapping[str, int],
    dst_slots: Mapping[str, int],
    pages: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A request: for some of the pools both sides have, (source, destination) slot indices.

    ``pages`` gives each pool's (source, destination) pages a slot (``Layout.pages``).
    """
    out = {}
    for pool in sorted(set(src_slots) & set(dst_slots)):
        if draw(st.integers(0, 4)) == 4:  # a pool left out is not transferred
            continue
        ratio = (pages or {}).get(pool, (1, 1))
        out[pool] = draw(slot_pairs(src_slots[pool], dst_slots[pool], *ratio))
    return out


class Regions(NamedTuple):
    """Regions one rank could offer, and the TP position they were drawn for."""

    regions: list[Region]
    tp_rank: int
    tp_size: int


@st.composite
def manifest_regions(draw: st.DrawFn, *, max_regions: int = 8) -> Regions:
    """Valid, non-overlapping regions in a random order; some of them empty.

    Addresses are synthetic (nothing is allocated): this is for manifest tests.
    """
    tp_size = draw(st.integers(1, 4))
    tp_rank = draw(st.integers(0, tp_size - 1))
    keys = draw(st.lists(_keys, min_size=0, max_size=max_regions, unique=True))
    pool_slots = {p: draw(st.integers(1, 4)) for p in POOLS}
    addr = 0x10000
    regions = []
    for pool, name, layer, part in keys:
        itemsize = draw(st.sampled_from((1, 2, 4)))
        slot_shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        tp_axis = None
        sharded: bool = draw(st.booleans())
        if slot_shape and sharded:
            tp_axis = draw(st.integers(0, len(slot_shape) - 1))
        nbytes = pool_slots[pool] * math.prod(slot_shape) * itemsize
        regions.append(
            Region(
                pool=pool,
                name=name,
                layer=layer,
                part=part,
                addr=addr if nbytes else draw(st.sampled_from((0, addr))),
                nbytes=nbytes,
                slot_shape=slot_shape,
                itemsize=itemsize,
                tp_axis=tp_axis,
            )
        )
        addr += nbytes + draw(st.integers(0, 64))
    return Regions(draw(st.permutations(regions)), tp_rank, tp_size)


# -- what a peer might send ----------------------------------------------------------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)


def msgpack_values(max_leaves: int = 20) -> st.SearchStrategy[object]:
    """Any value msgpack carries: scalars (ints over its whole range), lists, string-keyed maps."""
    return st.recursive(
        _SCALARS,
        lambda inner: (
            st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        ),
        max_leaves=max_leaves,
    )


def wire_bytes(max_size: int = 200) -> st.SearchStrategy[bytes]:
    """Bytes a peer might send: random ones, or any msgpack value encoded (decodes, wrong shape)."""
    return st.binary(max_size=max_size) | msgpack_values().map(msgspec.msgpack.encode)
