"""Hypothesis strategies: random model layouts, requests and manifests.

Engines and plugin authors reuse them to drive their own property tests
against the reference model (``xferkit.testing.Reference``). Importing this
module needs ``hypothesis`` (a test dependency, not a runtime one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec
import numpy as np
from hypothesis import strategies as st

from ..manifest import Region
from .reference import Reference, RegionSpec

POOLS = ("kv", "state", "aux")
NAMES = ("k", "v", "conv", "temporal")

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
) -> RegionSpec:
    """One region's global slot shape and sharding, valid for every TP size in ``tp_sizes``.

    The sharded axis is sometimes not divisible by a TP size (ranks then hold
    overlapping shares, as GQA does with more ranks than KV heads), sometimes
    split into shard groups divisible by every TP size. ``empty`` forces (True)
    or forbids (False) a zero dimension, ``sharded`` a sharded axis; None lets
    hypothesis choose.
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
        axes = [i for i in range(ndim) if groups is None or i != tp_axis]
        if not axes:
            shape.append(0)
            ndim += 1
            axes = [ndim - 1]
        shape[draw(st.sampled_from(axes))] = 0
    return RegionSpec(
        pool=pool,
        name=name,
        layer=layer,
        part=part,
        shape=tuple(shape),
        itemsize=itemsize,
        tp_axis=tp_axis,
        tp_groups=groups,
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
) -> Layout:
    """A random model split over random TP sizes and pipeline stages on both sides.

    ``tp`` draws the (source, destination) TP sizes (default ``tp_pairs(max_tp)``);
    ``empty`` and ``sharded`` are passed to ``region_specs`` for every region.
    """
    src_tp, dst_tp = draw(tp if tp is not None else tp_pairs(max_tp))
    keys = draw(st.lists(_keys, min_size=1, max_size=max_regions, unique=True))
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
            )
        )
        for pool, name, layer, part in keys
    )
    pools = sorted({s.pool for s in specs})
    return Layout(
        specs=specs,
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_pp=draw(st.integers(1, max_pp)),
        dst_pp=draw(st.integers(1, max_pp)),
        src_slots={p: draw(st.integers(1, max_slots)) for p in pools},
        dst_slots={p: draw(st.integers(1, max_slots)) for p in pools},
    )


@st.composite
def slot_pairs(draw: st.DrawFn, src_slots: int, dst_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(source slots, destination slots) for one pool: distinct destinations, sources may repeat.

    Runs of consecutive slots on both sides are frequent (they must coalesce);
    the pairs come in a random order (expand must not care).
    """
    n = draw(st.integers(1, dst_slots + 1)) % (dst_slots + 1)  # now and then none at all
    if draw(st.booleans()):
        start = draw(st.integers(0, dst_slots - n))
        dst = list(range(start, start + n))
    else:
        dst = draw(st.permutations(range(dst_slots)))[:n]
    if n <= src_slots and draw(st.booleans()):
        start = draw(st.integers(0, src_slots - n))
        src = list(range(start, start + n))
    else:
        src = draw(st.lists(st.integers(0, src_slots - 1), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    return (
        np.array([src[i] for i in order], dtype=np.int64),
        np.array([dst[i] for i in order], dtype=np.int64),
    )


@st.composite
def slot_requests(
    draw: st.DrawFn, src_slots: Mapping[str, int], dst_slots: Mapping[str, int]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A request: for some of the pools both sides have, (source, destination) slot indices."""
    out = {}
    for pool in sorted(set(src_slots) & set(dst_slots)):
        if draw(st.integers(0, 4)) == 4:  # a pool left out is not transferred
            continue
        out[pool] = draw(slot_pairs(src_slots[pool], dst_slots[pool]))
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
