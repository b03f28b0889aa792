"""Pairing by key: a ``Plan`` of what one source rank writes into one destination rank.

``plan`` pairs two manifests' regions by key, aligns each pair once (``pieces``)
and groups regions whose alignments and slot sizes agree, so a request expands
each group in one broadcast (``expand``). ``Plan`` is what the rest of the core
sees: its named methods are the whole interface staging and coverage use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import numpy as np

from ..arguments import expect
from ..descriptors import Descriptors
from ..errors import PlanError
from ..manifest import STAGING_POOL, Manifest, Region, RegionKey
from .expand import Layers, PagePairs, RegionGroup, Slots, expand_groups, of_layers, page_pairs
from .pieces import NO_PIECES, Alignment, Pieces, align, geometry

LAYER_SETS = 256
"""Layer sets whose region groups a ``Plan`` keeps at once (a bound: callers choose them)."""


class Plan:
    """What source rank ``src_rank`` writes into destination rank ``dst_rank``.

    Compute once per manifest pair with ``plan(src, dst)``; call ``expand`` per request.
    """

    __slots__ = (
        "_alignments",
        "_groups",
        "_layered",
        "_origin",
        "_pool_layers",
        "_slots",
        "dst_rank",
        "src_rank",
    )

    def __init__(
        self,
        src: Manifest,
        dst: Manifest,
        groups: list[RegionGroup],
        alignments: dict[RegionKey, Alignment],
        pages: dict[str, tuple[int, int]],
    ) -> None:
        self.src_rank = src.tp_rank
        self.dst_rank = dst.tp_rank
        # A request is one destination rank's: it may name any pool that rank has, even
        # one whose regions were all dropped or that this source's pipeline stage lacks.
        known = (set(dst.pools) | {k[0] for k in dst.dropped_keys}) - {STAGING_POOL}
        self._slots = Slots(
            frozenset(known),
            MappingProxyType(dict(src.pools)),
            MappingProxyType(dict(dst.pools)),
            MappingProxyType(pages),
        )
        self._groups = tuple(groups)
        self._layered: dict[frozenset[int], tuple[RegionGroup, ...]] = {}
        self._pool_layers: dict[str, frozenset[int]] = {}
        for g in self._groups:
            had = self._pool_layers.get(g.pool, frozenset())
            self._pool_layers[g.pool] = had | {k[2] for k in g.keys}
        self._alignments = alignments
        self._origin = (src, dst)

    @property
    def manifests(self) -> tuple[Manifest, Manifest]:
        """The (source, destination) manifests planned over: what its descriptors are sealed to."""
        return self._origin

    @property
    def src_slots(self) -> Mapping[str, int]:
        """Slot count of each pool on the source (read-only: requests are checked against it)."""
        return self._slots.src

    @property
    def dst_slots(self) -> Mapping[str, int]:
        """Slot count of each pool on the destination (read-only)."""
        return self._slots.dst

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

    @property
    def groups(self) -> tuple[RegionGroup, ...]:
        """The region groups, each expanded in one broadcast (what staging routes)."""
        return self._groups

    def alignment(self, key: object) -> Alignment | None:
        """How the two sides of ``key`` line up; None when this source writes none of it."""
        try:
            return self._alignments.get(key)  # type: ignore[call-overload]
        except TypeError:  # unhashable: no key of ours
            msg = f"a region key is a (pool, name, layer, part) tuple, not {key!r}"
            raise PlanError(msg) from None

    def pieces(self, key: RegionKey) -> Pieces:
        """The copies within one page of ``key`` (empty when this source writes none of it)."""
        alignment = self.alignment(key)
        return NO_PIECES if alignment is None else alignment.pieces

    def pages(self, pool: str) -> tuple[int, int] | None:
        """(source, destination) pages per slot of ``pool``: ``(1, 4)`` when a destination slot
        holds four source slots' tokens (``Region.axes``), ``(1, 1)`` when slots pair one to
        one; None when no region of ``pool`` pairs here (another stage's, or all dropped), so
        nothing of it moves between these two ranks."""
        expect(pool, str, "Plan.pages() (a pool name)")
        return self._slots.pages.get(pool)

    def describe(self, key: RegionKey) -> str:
        """How the two sides' layouts of ``key`` line up ("" when alike)."""
        alignment = self.alignment(key)
        return "" if alignment is None else alignment.note

    def expand(
        self, request: Mapping[str, tuple[object, object]], layers: Layers = None
    ) -> Descriptors:
        """Descriptors for a request: ``request[pool] = (src_slot_indices, dst_slot_indices)``.

        Pools of the plan absent from ``request`` are not transferred; with ``layers``
        (a frozenset of layer ids: a layer-wise chunk), only those layers' regions are.
        Every input is checked before anything is produced.
        """
        return self.expand_groups(self.page_pairs(request), self.of_layers(layers))

    def of_layers(self, layers: Layers) -> tuple[RegionGroup, ...]:
        """The region groups holding only the regions of ``layers`` (None: all of them)."""
        if layers is None:
            return self._groups
        expect(layers, frozenset, "Plan.of_layers() (a frozenset of layer ids)")
        got = self._layered.get(layers)
        if got is None:
            if len(self._layered) >= LAYER_SETS:
                self._layered.clear()  # an engine uses a few sets (each layer, a range)
            got = tuple(h for g in self._groups if (h := of_layers(g, layers)) is not None)
            self._layered[layers] = got
        return got

    def layers(self, pool: str) -> frozenset[int]:
        """The layers of ``pool`` this source writes something into this destination."""
        return self._pool_layers.get(expect(pool, str, "Plan.layers() (a pool name)"), frozenset())

    def page_pairs(self, request: Mapping[str, tuple[object, object]]) -> dict[str, PagePairs]:
        """Each pool of ``request`` checked and turned into page pairs, sorted by destination."""
        expect(request, Mapping, "a request (pool -> (src_slots, dst_slots))")
        return {pool: page_pairs(pool, pair, self._slots) for pool, pair in request.items()}

    def expand_groups(
        self, pairs: Mapping[str, PagePairs], groups: Iterable[RegionGroup]
    ) -> Descriptors:
        """Descriptors of some of this plan's ``groups`` for ``page_pairs``' result."""
        return expand_groups(pairs, groups, self._origin)


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
    alignments: dict[RegionKey, Alignment] = {}
    pages: dict[str, tuple[int, int]] = {}
    for a in src.regions:
        if a.key not in dst or a.pool == STAGING_POOL:
            continue
        b = dst.region(a.key)
        alignment = align(
            geometry(a), src.tp_rank, src.tp_size, geometry(b), dst.tp_rank, dst.tp_size
        )
        if isinstance(alignment, str):
            raise PlanError(f"region {a.label}: {alignment}", subject=a.key)
        ratio = (alignment.src_pages, alignment.dst_pages)
        first = pages.setdefault(a.pool, ratio)
        if first != ratio:
            raise PlanError(
                f"region {a.label}: {ratio[0]} source and {ratio[1]} destination pages per slot, "
                f"but other regions of pool {a.pool!r} pair {first[0]} and {first[1]}: a request "
                "names one set of slots per pool",
                subject=a.key,
            )
        alignments[a.key] = alignment
        if alignment.pieces.src.size == 0:
            continue
        bucket = (a.pool, a.slot_nbytes, b.slot_nbytes, id(alignment))
        buckets.setdefault(bucket, []).append((a, b))
    groups = [
        _group(pool, s_stride, d_stride, alignments[pairs[0][0].key], pairs)
        for (pool, s_stride, d_stride, _), pairs in buckets.items()
    ]
    return Plan(src, dst, groups, alignments, pages)


def _group(
    pool: str,
    src_stride: int,
    dst_stride: int,
    alignment: Alignment,
    pairs: list[tuple[Region, Region]],
) -> RegionGroup:
    t = alignment.pieces
    return RegionGroup(
        pool=pool,
        keys=tuple(a.key for a, _ in pairs),
        src_base=np.array([a.addr for a, _ in pairs], dtype=np.uint64),
        dst_base=np.array([b.addr for _, b in pairs], dtype=np.uint64),
        src_stride=src_stride,
        dst_stride=dst_stride,
        alignment=alignment,
        src_span=np.uint64(t.src[-1] + t.nbytes[-1] - t.src[0]),
        dst_span=np.uint64(t.dst[-1] + t.nbytes[-1] - t.dst[0]),
    )


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
