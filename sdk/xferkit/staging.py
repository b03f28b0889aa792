"""Staged routes: pack strided pieces into contiguous staging memory, send few large copies, unpack.

A heterogeneous-TP plan over an NHD layout owes one piece per token row
(4 -> 8: a head out of each row of the source page), and every wire
descriptor costs a driver microseconds while a local strided copy runs at
memory bandwidth. So, per region group of a ``Plan``, ``stage`` picks a route
from a cost model:

- ``direct``: the plan's pieces go on the wire as they are;
- ``pack``: the source gathers its strided pieces, in destination order, into
  staging; one wire copy per slot lands on the destination's contiguous range;
- ``unpack``: the source's contiguous range lands in the destination's staging,
  which the destination scatters into its strided pieces;
- ``both``: gather, one wire copy per round for the whole staging block, scatter.

A unit is one slot pair of one region: ``unit`` bytes of staging on each side
that stages. Units are laid out region-major, in destination slot order, and
cut into rounds that fit the staging capacities; both sides compute the same
rounds from the same plan, request and capacities, so only the staging base
addresses need to travel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Literal, NamedTuple, get_args

import numpy as np

from .arguments import expect
from .costs import COPY_COST, copy_cost_problem, descriptor_bytes_problem
from .descriptors import Descriptors, merge_neighbours
from .errors import PlanError
from .manifest import RegionKey, key_label
from .planner import PagePairs, Pieces, Plan, RegionGroup
from .planner.expand import Layers, of_layers
from .planner.plan import LAYER_SETS

RoutePath = Literal["direct", "pack", "unpack", "both"]
PATHS: tuple[RoutePath, ...] = get_args(RoutePath)
Force = RoutePath | Literal["staged"] | None
Side = Literal["send", "unpack"]
"""Which copies of a round one side computes: the source's (pack, wire) or the destination's."""

FORCE: dict[str, Force] = {"auto": None, "always": "staged"}
"""A Session's ``staging`` setting as ``stage``'s ``force`` ("never" stages nothing)."""

_UNBOUNDED = 1 << 62
"""A capacity beyond any memory, clear of uint64 overflow when offsets are added to it."""


class Route(NamedTuple):
    """How a region group moves, and why the cost model chose it."""

    path: RoutePath
    why: str


class _Local(NamedTuple):
    """A unit's copies between its slot and its staging block, pieces that follow on both
    sides joined: a page whose rows lie in order on the slot's side is one copy, not one a
    row (Llama's 16-token NHD pages unpacked at decode TP 4: 16 copies of 512 bytes a page
    move 5.5 GB/s, one of 8 KiB 6.9; ``bench_copier.py``'s ``pages`` rows)."""

    slot: np.ndarray  # offset within the slot
    block: np.ndarray  # offset within the unit's staging block
    nbytes: np.ndarray

    @classmethod
    def of(cls, slot: np.ndarray, nbytes: np.ndarray) -> _Local:
        """Pieces at ``slot`` offsets, laid end to end in staging in that order."""
        return cls(*merge_neighbours(slot, _offsets(nbytes), nbytes))


class _RoutedGroup(NamedTuple):
    """One group's route and the piece tables its copies need."""

    group: RegionGroup
    path: RoutePath
    unit: int  # bytes per (region, slot pair)
    pieces: Pieces  # sorted by destination (pack, both) or by source (unpack)
    packs: _Local  # the source's slot -> staging copies of a unit
    unpacks: _Local  # the destination's staging -> slot copies of a unit

    @property
    def src_side(self) -> bool:
        return self.path in ("pack", "both")

    @property
    def dst_side(self) -> bool:
        return self.path in ("unpack", "both")


def _contiguous(start: np.ndarray, nbytes: np.ndarray) -> bool:
    return bool(np.all(start[:-1] + nbytes[:-1] == start[1:]))


def _choose(
    g: RegionGroup, descriptor_bytes: int, copy_cost: float, force: Force
) -> tuple[Route, Pieces]:
    p = g.pieces
    count, unit = p.src.size, int(p.nbytes.sum())
    by_src = np.argsort(p.src, kind="stable")
    src_order = Pieces(p.src[by_src], p.dst[by_src], p.nbytes[by_src])
    dst_contig = _contiguous(p.dst, p.nbytes)
    src_contig = _contiguous(src_order.src, src_order.nbytes)
    copy = copy_cost * unit
    # Where a slot holds k pages of the other side's and a page's range on the staged side is
    # contiguous and as long as a page, the k wire copies of its pages join into one.
    a = g.alignment
    joins = {
        "pack": a.dst_pages if dst_contig and unit == a.dst_shift else 1,
        "unpack": a.src_pages if src_contig and unit == a.src_shift else 1,
    }
    costs: dict[RoutePath, float] = {"direct": count * descriptor_bytes, "both": 2 * copy}
    if dst_contig:
        costs["pack"] = descriptor_bytes / joins["pack"] + copy
    if src_contig:
        costs["unpack"] = descriptor_bytes / joins["unpack"] + copy
    note = f"{a.note}; " if a.note else ""
    if force in PATHS:
        path: RoutePath = force if force in costs else "both"  # type: ignore[assignment]
        why = f"forced {force}" + ("" if force == path else f" (not possible: {path})")
    else:
        allowed = [q for q in PATHS if q in costs and (force != "staged" or q != "direct")]
        path = min(allowed, key=lambda q: costs[q])  # ties keep the earlier, simpler path
        shape = (
            f"{count} piece{'s' * (count != 1)} of {unit} bytes per page "
            f"(source {'contiguous' if src_contig else 'strided'}, "
            f"destination {'contiguous' if dst_contig else 'strided'}); cost per page "
            + ", ".join(f"{q} {costs[q]:.0f}" for q in PATHS if q in costs)
            + f" byte-equivalents at {descriptor_bytes} per wire descriptor and "
            f"{copy_cost:g} per copied byte"
        )
        why = ("forced staged: " if force == "staged" else "") + shape
    return Route(path, note + why), src_order if path == "unpack" else p


def _offsets(nbytes: np.ndarray) -> np.ndarray:
    at = np.zeros(nbytes.size, dtype=np.uint64)
    np.cumsum(nbytes[:-1], out=at[1:])
    return at


class StagedPlan:
    """A ``Plan`` with a route per region group; ``expand`` cuts a request into rounds.

    Build it with ``stage(plan, descriptor_bytes=backend.capabilities.descriptor_bytes)``
    on both sides of a pair: the routes and rounds are a pure function of the
    plan, the driver's cost and the request.
    """

    def __init__(
        self, plan: Plan, groups: list[_RoutedGroup], routes: dict[RegionKey, Route]
    ) -> None:
        self.plan = plan
        self.routes: Mapping[RegionKey, Route] = routes
        self._direct = [s.group for s in groups if s.path == "direct"]
        # "both" groups first on each side, so their wire copies join into one per round.
        order = {"both": 0, "pack": 1, "unpack": 1}
        self._staged = sorted(
            (s for s in groups if s.path != "direct"), key=lambda s: order[s.path]
        )
        self._layered: dict[frozenset[int], tuple[list[RegionGroup], list[_RoutedGroup]]] = {}
        # The pools a destination unpacks from staging: asked once per request per source.
        self._unpacked = frozenset(s.group.pool for s in self._staged if s.dst_side)

    def _of_layers(self, layers: Layers) -> tuple[list[RegionGroup], list[_RoutedGroup]]:
        """The direct and staged groups with only the regions of ``layers`` (None: all)."""
        if layers is None:
            return self._direct, self._staged
        expect(layers, frozenset, "StagedPlan.expand(layers=) (a frozenset of layer ids)")
        got = self._layered.get(layers)
        if got is None:
            if len(self._layered) >= LAYER_SETS:
                self._layered.clear()
            direct = [h for g in self._direct if (h := of_layers(g, layers)) is not None]
            staged = [
                s._replace(group=h)
                for s in self._staged
                if (h := of_layers(s.group, layers)) is not None
            ]
            got = self._layered[layers] = (direct, staged)
        return got

    @property
    def staged(self) -> bool:
        """True when some group goes through staging."""
        return bool(self._staged)

    def packs(self, pools: Iterable[str]) -> bool:
        """Whether a request naming ``pools`` needs source staging."""
        return any(s.src_side and s.group.pool in pools for s in self._staged)

    def unpacks(self, pools: Iterable[str]) -> bool:
        """Whether a request naming ``pools`` needs destination staging."""
        return not self._unpacked.isdisjoint(pools)

    def expand(
        self,
        request: Mapping[str, tuple[object, object]],
        *,
        src_capacity: int,
        dst_capacity: int,
        direct: bool = True,
        layers: Layers = None,
    ) -> StagedRequest:
        """The direct descriptors and the staged rounds of ``request`` (as ``Plan.expand``'s).

        Each round needs at most ``src_capacity`` bytes of source staging and
        ``dst_capacity`` of destination staging; a unit larger than either is a
        ``PlanError`` naming its region. ``direct=False`` leaves the direct
        descriptors out: the unpacking side needs only the rounds. ``layers`` (a
        frozenset of layer ids) keeps only those layers' regions: a layer-wise chunk.
        """
        expect(request, Mapping, "StagedPlan.expand() (pool -> (src_slots, dst_slots))")
        for name, cap in (("src_capacity", src_capacity), ("dst_capacity", dst_capacity)):
            if type(cap) is not int or cap < 0:
                raise PlanError(f"{name} must be an int >= 0, not {cap!r}")
        src_capacity, dst_capacity = min(src_capacity, _UNBOUNDED), min(dst_capacity, _UNBOUNDED)
        slots = self.plan.page_pairs(request)
        direct_groups, staged_groups = self._of_layers(layers)
        on_wire = self.plan.expand_groups(slots, direct_groups) if direct else Descriptors.empty()
        parts: list[tuple[_RoutedGroup, PagePairs]] = []
        requested: dict[str, PagePairs] = {}
        for s in staged_groups:
            pairs = slots.get(s.group.pool)
            if pairs is None or not pairs.src.size:
                continue
            if s.path == "unpack":
                # An unpacked group's wire copies land in consecutive staging blocks, so they
                # join where the source's pages follow each other in the request (the short
                # pages of one long source slot, a prefill's run of slots) rather than where
                # the destination's do. Both sides know that order; the source's slots only
                # the source.
                if s.group.pool not in requested:
                    requested[s.group.pool] = pairs.in_request_order()
                pairs = requested[s.group.pool]
            parts.append((s, pairs))
        for s, _ in parts:
            for side, cap, used in (
                ("source", src_capacity, s.src_side),
                ("destination", dst_capacity, s.dst_side),
            ):
                if used and s.unit > cap:
                    raise PlanError(
                        f"{side} staging of {cap} bytes cannot hold one slot of region group "
                        f"{key_label(s.group.keys[0])} ({s.unit} bytes, route {s.path})",
                        subject=s.group.keys[0],
                    )
        return StagedRequest(on_wire, _rounds(parts, src_capacity, dst_capacity))

    def expand_direct(
        self, request: Mapping[str, tuple[object, object]], layers: Layers = None
    ) -> Descriptors:
        """The direct descriptors of ``request`` alone (``expand``'s ``direct``): what a chunk
        joined to another's staged rounds still writes itself."""
        direct_groups, _ = self._of_layers(layers)
        if not direct_groups:
            return Descriptors.empty()
        return self.plan.expand_groups(self.plan.page_pairs(request), direct_groups)


class _Part(NamedTuple):
    """Units [u0, u1) of one group in one round, and where their staging blocks start."""

    staged: _RoutedGroup
    slots: PagePairs
    u0: int
    u1: int
    src_at: int
    dst_at: int


class Round:
    """One pass through staging: what to pack, send and unpack, given the staging bases."""

    def __init__(self, parts: list[_Part], src_bytes: int, dst_bytes: int) -> None:
        self._parts = parts
        self.src_bytes = src_bytes
        self.dst_bytes = dst_bytes

    def __repr__(self) -> str:
        units = sum(p.u1 - p.u0 for p in self._parts)
        return f"Round({units} units, staging {self.src_bytes} + {self.dst_bytes} bytes)"

    def expand(self, src_stage: int, dst_stage: int, *, only: Side | None = None) -> RoundCopies:
        """Absolute copies with the source's staging at ``src_stage``, the destination's at
        ``dst_stage`` (each ``src_bytes`` / ``dst_bytes`` long). ``only="send"``: the pack
        and wire copies alone (what the source needs), ``only="unpack"``: the unpack copies
        alone (the destination); the others come empty, not computed."""
        for name, at, size in (
            ("src", src_stage, self.src_bytes),
            ("dst", dst_stage, self.dst_bytes),
        ):
            if isinstance(at, bool) or not isinstance(at, Integral) or not 0 <= at < 2**64 - size:
                raise PlanError(
                    f"{name}_stage must be an address with {size} bytes above it, not {at!r}"
                )
        if only is not None and (not isinstance(only, str) or only not in ("send", "unpack")):
            raise PlanError(f"only must be None, 'send' or 'unpack', not {only!r}")
        src, dst = int(src_stage), int(dst_stage)
        parts = [_expand_part(part, src, dst, only) for part in self._parts]
        if len(parts) == 1:
            return parts[0]  # an engine's usual chunk: one group (every layer's K and V)
        # Staging to staging ("both"; they come first) joins into one copy across groups;
        # a copy from or into slots joins only within its region (``_expand_part``).
        paths = [part.staged.path for part in self._parts]
        both = [p.wire for p, path in zip(parts, paths, strict=True) if path == "both"]
        rest = [p.wire for p, path in zip(parts, paths, strict=True) if path != "both"]
        return RoundCopies(
            Descriptors.concat([p.pack for p in parts if len(p.pack)]),
            Descriptors.concat(
                [_join(Descriptors.concat([w for w in both if len(w)]))]
                + [w for w in rest if len(w)]
            ),
            Descriptors.concat([p.unpack for p in parts if len(p.unpack)]),
        )


class RoundCopies(NamedTuple):
    """A round's copies: local on the source, on the wire, local on the destination."""

    pack: Descriptors
    wire: Descriptors
    unpack: Descriptors


class StagedRequest(NamedTuple):
    direct: Descriptors
    rounds: list[Round]

    @property
    def src_bytes(self) -> int:
        """Most source staging any round uses."""
        return max((r.src_bytes for r in self.rounds), default=0)

    @property
    def dst_bytes(self) -> int:
        return max((r.dst_bytes for r in self.rounds), default=0)


def _rounds(parts: list[tuple[_RoutedGroup, PagePairs]], src_cap: int, dst_cap: int) -> list[Round]:
    """Cut the units, in order, into rounds greedily: one loop step per round, not per unit.
    A chunk that fits the staging whole (an engine's usual one) is one round, cut in plain
    integers: the greedy cut's dozen numpy calls were a fifth of a small chunk's planning."""
    if not parts:
        return []
    out, s_at, d_at = [], 0, 0
    for s, sl in parts:
        count = s.group.src_base.size * sl.src.size
        out.append(_Part(s, sl, 0, count, s_at, d_at))
        s_at += count * s.unit * s.src_side
        d_at += count * s.unit * s.dst_side
    if s_at <= src_cap and d_at <= dst_cap:
        return [Round(out, s_at, d_at)]
    return _greedy(parts, src_cap, dst_cap)


def _greedy(parts: list[tuple[_RoutedGroup, PagePairs]], src_cap: int, dst_cap: int) -> list[Round]:
    """``_rounds`` for a chunk larger than the staging: several rounds, each as full as fits."""
    if not parts:
        return []
    # Per unit: staging bytes on each side; units of group j are counts[j] in a row.
    counts = np.array([s.group.src_base.size * sl.src.size for s, sl in parts], dtype=np.int64)
    src_unit = np.array([s.unit * s.src_side for s, _ in parts], dtype=np.int64)
    dst_unit = np.array([s.unit * s.dst_side for s, _ in parts], dtype=np.int64)
    ends = np.cumsum(counts)
    src_cum = np.concatenate(([0], np.cumsum(np.repeat(src_unit, counts))))
    dst_cum = np.concatenate(([0], np.cumsum(np.repeat(dst_unit, counts))))
    total = int(ends[-1])
    rounds, u = [], 0
    while u < total:
        # The last unit index v with both sides' bytes [u, v) within capacity.
        v = min(
            int(np.searchsorted(src_cum, src_cum[u] + src_cap, side="right")) - 1,
            int(np.searchsorted(dst_cum, dst_cum[u] + dst_cap, side="right")) - 1,
            total,
        )
        assert v > u  # every unit fits: checked by the caller
        out, s_at, d_at = [], 0, 0
        for j in range(int(np.searchsorted(ends, u, side="right")), len(parts)):
            start = int(ends[j] - counts[j])
            lo, hi = max(u, start) - start, min(v, int(ends[j])) - start
            if lo >= hi:
                break
            s, sl = parts[j]
            out.append(_Part(s, sl, lo, hi, s_at, d_at))
            s_at += (hi - lo) * int(src_unit[j])
            d_at += (hi - lo) * int(dst_unit[j])
        rounds.append(Round(out, s_at, d_at))
        u = v
    return rounds


_NONE = Descriptors.empty()  # what a side that copies nothing gets (nothing to write into)


def _expand_part(part: _Part, src_stage: int, dst_stage: int, only: Side | None) -> RoundCopies:
    s, g = part.staged, part.staged.group
    send, unpack = only != "unpack", only != "send"
    src, dst = part.slots.offsets(g)
    n, u0, count = src.size, part.u0, part.u1 - part.u0
    # Units run region-major over (region, slot pair): the part's units are a run of the outer
    # sum of its regions' bases and its pairs' offsets (a broadcast add, no division).
    r0, r1 = u0 // n, -(-part.u1 // n)
    run = slice(u0 - r0 * n, part.u1 - r0 * n)
    block = np.arange(count, dtype=np.uint64) * np.uint64(s.unit)
    none = _NONE
    p = s.pieces

    def scatter(base: np.ndarray, local: _Local, stage: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per unit and copy: (slot address + its offset, staging + its offset in the block)."""
        return (
            (base[:, None] + local.slot[None, :]).ravel(),
            (stage[:, None] + local.block[None, :]).ravel(),
            np.repeat(local.nbytes[None, :], count, axis=0).ravel(),  # np.tile, one C call
        )

    def slots(bases: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return (bases[r0:r1, None] + offsets[None, :]).ravel()[run]

    src_block = block + np.uint64(src_stage + part.src_at)
    dst_block = block + np.uint64(dst_stage + part.dst_at)
    pack = wire = unpacked = none
    if s.path == "pack":
        if send:
            src_slot = slots(g.src_base, src)
            a, b, ln = scatter(src_slot, s.packs, src_block)
            pack = Descriptors(a, b, ln)
            wire = _wire(src_block, slots(g.dst_base, dst) + p.dst[0], s.unit, u0, n)
    elif s.path == "unpack":
        if send:
            wire = _wire(slots(g.src_base, src) + p.src[0], dst_block, s.unit, u0, n)
        if unpack:
            a, b, ln = scatter(slots(g.dst_base, dst), s.unpacks, dst_block)
            unpacked = Descriptors(b, a, ln)
    else:
        if send:
            a, b, ln = scatter(slots(g.src_base, src), s.packs, src_block)
            # Consecutive blocks on both sides: the part's wire copies join into one.
            size = np.full(1, count * s.unit, dtype=np.uint64)
            wire = Descriptors(src_block[:1], dst_block[:1], size)
            pack = Descriptors(a, b, ln)
        if unpack:
            c, d, ln = scatter(slots(g.dst_base, dst), s.unpacks, dst_block)
            unpacked = Descriptors(d, c, ln)
    return RoundCopies(pack, wire, unpacked)


def _wire(src: np.ndarray, dst: np.ndarray, unit: int, u0: int, n: int) -> Descriptors:
    """One wire copy a unit, joined where contiguous on both sides but never across a region
    (units ``u0``... run region-major over ``n`` slot pairs: each region's first starts one)."""
    nbytes = np.full(src.size, unit, dtype=np.uint64)
    if n == 1:  # a unit a region (a one-page chunk): nothing joins
        return Descriptors(src, dst, nbytes)
    apart = np.zeros(src.size, dtype=bool)
    apart[(-u0) % n :: n] = True
    apart[0] = True
    return _join(Descriptors(src, dst, nbytes), apart)


def _join(d: Descriptors, apart: np.ndarray | None = None) -> Descriptors:
    """Merge neighbours contiguous on both sides (consecutive staging blocks, runs of slots),
    never into a copy ``apart`` marks (the first of a region within its group): regions laid
    end to end in memory are still registered one by one."""
    src, dst, nbytes = merge_neighbours(d.src, d.dst, d.nbytes, apart)
    return d if src is d.src else Descriptors(src, dst, nbytes)


def stage(
    plan: Plan, *, descriptor_bytes: int, copy_cost: float = COPY_COST, force: Force = None
) -> StagedPlan:
    """Choose each region group's route: the cheapest in wire-byte equivalents.

    ``descriptor_bytes`` is what one wire descriptor costs the driver, in bytes
    it could have moved instead (``Capabilities.descriptor_bytes``); ``copy_cost`` what a
    locally copied byte costs in wire bytes (``Capabilities.copy_cost``). ``force``
    pins a path for every group (``"staged"``: the cheapest one that is not
    direct; a path a group's pieces cannot take falls back to ``"both"``).
    """
    expect(plan, Plan, "stage(plan, ...)")
    problem = descriptor_bytes_problem(descriptor_bytes) or copy_cost_problem(copy_cost)
    if problem:
        raise PlanError(problem)
    if force is not None and force not in (*PATHS, "staged"):
        raise PlanError(f"force must be None, 'staged' or one of {PATHS}, not {force!r}")
    groups, routes = [], {}
    for g in plan.groups:
        route, pieces = _choose(g, descriptor_bytes, float(copy_cost), force)
        packs, unpacks = (_Local.of(side, pieces.nbytes) for side in (pieces.src, pieces.dst))
        groups.append(_RoutedGroup(g, route.path, int(pieces.nbytes.sum()), pieces, packs, unpacks))
        routes.update(dict.fromkeys(g.keys, route))
    return StagedPlan(plan, groups, routes)
