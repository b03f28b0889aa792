"""Properties of plan / coverage / expand over random layouts, checked against the reference model.

Layouts (``xferkit.testing.layouts``) vary itemsize, slot rank, the sharded
axis and its position, shard groups, axes not divisible by the TP size
(overlapping shares, as GQA), empty regions, several pools and parts, TP
sizes 1..8 on each side (3 -> 2, 2 -> 3, ...) and PP splits 1..3 on each
side; requests have distinct destination slots and possibly repeated source
slots, in a random order. With ``views`` layouts also name axes, order them
per side and give pools page ratios (a slot holding 2..4 of the other side's
pages), with requests paired page by page.
"""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit import Descriptors, coverage
from xferkit.planner.expand import _expand_group
from xferkit.testing import Rank, layouts, slot_pairs, slot_requests
from xferkit.testing.checks import byte_runs, check_descriptors, for_rank, handoff
from xferkit.testing.strategies import INTERESTING_TP, Layout, tp_pairs

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 2**32 - 1)


@settings(SETTINGS, max_examples=100)
@given(data=st.data())
def test_handoff_matches_reference(data: st.DataObject) -> None:
    """Every requested byte equals the reference, the rest is untouched, nothing written twice,
    no zero-length descriptor, counts minimal, bytes moved equal bytes requested."""
    layout = data.draw(layouts())
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    handoff(layout.reference(seed=data.draw(seeds)), request)


@settings(SETTINGS, max_examples=50)
@given(data=st.data())
def test_non_whole_ratios_and_replication(data: st.DataObject) -> None:
    """Unequal TP sizes (3 -> 2, 2 -> 3, 4 -> 6, ...) with every region sharded and non-empty."""
    pairs = st.sampled_from([p for p in INTERESTING_TP if p[0] != p[1]])
    layout = data.draw(layouts(max_pp=1, tp=pairs, empty=False, sharded=True))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    handoff(layout.reference(seed=data.draw(seeds)), request)


@settings(SETTINGS, max_examples=50)
@given(data=st.data())
def test_replicated_on_one_side_sharded_on_the_other(data: st.DataObject) -> None:
    """A region replicated on one side (tp_axis None) and sharded on the other: the sharded
    side takes its share from the designated replica, or the replicated side gathers it."""
    layout = data.draw(layouts(max_pp=1, sharded=True))
    flip = [data.draw(st.sampled_from(("src", "dst", None))) for _ in layout.specs]
    replicated = [msgspec.structs.replace(s, tp_axis=None, tp_groups=None) for s in layout.specs]
    src_specs = [
        r if f == "src" else s for s, r, f in zip(layout.specs, replicated, flip, strict=True)
    ]
    dst_specs = [
        r if f == "dst" else s for s, r, f in zip(layout.specs, replicated, flip, strict=True)
    ]
    # The reference is built on the destination's specs (what "expected" shards by); the
    # source ranks are rebuilt from the source's specs over the same global tensors.
    ref = layout._replace(specs=tuple(dst_specs)).reference(seed=data.draw(seeds))
    ref.srcs = [
        Rank(src_specs, tp_rank=t, tp_size=layout.src_tp, pp_stage=0, fill=ref.global_src)
        for t in range(layout.src_tp)
    ]
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    handoff(ref, request)


VIEW_TP = st.sampled_from([(1, 1), (2, 2), (4, 8), (8, 4), (3, 2), (2, 3), (1, 4), (4, 1)])


@settings(SETTINGS, max_examples=60)
@given(data=st.data())
def test_named_axes_and_page_ratios(data: st.DataObject) -> None:
    """Each side lays its axes out in its own order (NHD on one, HND on the other, any
    permutation) and a pool's slots may hold 2..4 times the other side's pages: the i-th
    source page lands in its destination slot's i-th token block, the last slot in part."""
    layout = data.draw(layouts(max_pp=1, tp=VIEW_TP | tp_pairs(8), views=True))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots, layout.pages))
    handoff(layout.reference(seed=data.draw(seeds)), request)


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_page_ratios_every_region_sharded(data: st.DataObject) -> None:
    """Page ratios and reordered axes with every region sharded and non-empty, unequal TP."""
    layout = data.draw(layouts(max_pp=1, tp=VIEW_TP, views=True, empty=False, sharded=True))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots, layout.pages))
    handoff(layout.reference(seed=data.draw(seeds)), request)


@settings(SETTINGS, max_examples=50)
@given(data=st.data())
def test_pipeline_splits(data: st.DataObject) -> None:
    """Both sides split over 2..3 pipeline stages: each source plans only what it holds."""
    layout = data.draw(layouts(max_tp=4))
    layout = layout._replace(
        src_pp=data.draw(st.integers(2, 3)), dst_pp=data.draw(st.integers(1, 3))
    )
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    handoff(layout.reference(seed=data.draw(seeds)), request)


@SETTINGS
@given(layout=layouts(max_pp=2))
def test_pieces_tile_each_destination_slot_once(layout: Layout) -> None:
    """Painting every source's pieces onto a destination slot covers each byte exactly once.

    Independent of ``coverage``'s own proof; also checks that a piece stays inside
    the slot on both sides and that pieces of one plan are sorted and not mergeable.
    """
    ref = layout.reference()
    srcs = [r.manifest for r in ref.srcs]
    for rank in ref.dsts:
        dst = rank.manifest
        plans = coverage(srcs, dst).plans
        for region in dst.regions:
            painted = np.zeros(region.slot_nbytes, dtype=np.int64)
            for i, p in plans.items():
                pc = p.pieces(region.key)
                if not pc.src.size:
                    continue
                src_slot = srcs[i].region(region.key).slot_nbytes
                assert (pc.nbytes > 0).all()
                assert (pc.src + pc.nbytes <= src_slot).all()
                assert (pc.dst + pc.nbytes <= region.slot_nbytes).all()
                assert (np.diff(pc.dst.astype(np.int64)) > 0).all()
                joined = (pc.dst[:-1] + pc.nbytes[:-1] == pc.dst[1:]) & (
                    pc.src[:-1] + pc.nbytes[:-1] == pc.src[1:]
                )
                assert not joined.any()
                for d, n in zip(pc.dst.tolist(), pc.nbytes.tolist(), strict=True):
                    painted[d : d + n] += 1
            assert (painted == 1).all(), f"{region.label}: bytes painted {set(painted.tolist())}"


@SETTINGS
@given(data=st.data())
def test_count_is_number_of_maximal_runs(data: st.DataObject) -> None:
    """Brute force: expanding one slot pair at a time and concatenating describes the same
    byte mapping as one expand, and one expand has exactly as many descriptors as that
    mapping has maximal runs (within a region)."""
    layout = data.draw(layouts(max_pp=1, max_tp=4))
    ref = layout.reference()
    srcs = [r.manifest for r in ref.srcs]
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    for rank in ref.dsts:
        for si, p in coverage(srcs, rank.manifest).plans.items():
            req = for_rank(rank.manifest, request)
            whole = p.expand(req)
            check_descriptors(whole, srcs[si], rank.manifest)
            singles = Descriptors.concat(
                [
                    p.expand({pool: (src[k : k + 1], dst[k : k + 1])})
                    for pool, (src, dst) in req.items()
                    for k in range(len(dst))
                ]
            )
            if not len(singles):
                assert not len(whole)
                continue
            regions = rank.manifest.locate(singles.dst, singles.nbytes)
            assert (regions >= 0).all(), "a descriptor is not inside one destination region"
            runs, total = byte_runs(singles.src, singles.dst, singles.nbytes, regions)
            assert len(whole) == runs
            assert whole.total_bytes == total
            # Same bytes from the same places: compare the byte mappings.
            assert _mapping(whole) == _mapping(singles)


def _mapping(d: Descriptors) -> set[tuple[int, int]]:
    return {
        (dst + i, src + i)
        for src, dst, n in zip(d.src.tolist(), d.dst.tolist(), d.nbytes.tolist(), strict=True)
        for i in range(n)
    }


@SETTINGS
@given(data=st.data())
def test_expand_is_reusable_and_ignores_pair_order(data: st.DataObject) -> None:
    """A plan expands the same request twice identically, and a permuted request equally."""
    layout = data.draw(layouts(max_pp=1, max_tp=4))
    ref = layout.reference()
    srcs = [r.manifest for r in ref.srcs]
    pool = data.draw(st.sampled_from(sorted(layout.src_slots)))
    src, dst = data.draw(slot_pairs(layout.src_slots[pool], layout.dst_slots[pool]))
    perm = np.array(data.draw(st.permutations(range(len(dst)))), dtype=np.int64)
    for rank in ref.dsts:
        for p in coverage(srcs, rank.manifest).plans.values():
            if pool not in p.src_slots or pool not in p.dst_slots:
                continue
            a = p.expand({pool: (src, dst)})
            b = p.expand({pool: (src, dst)})
            c = p.expand({pool: (src[perm], dst[perm])})
            for x, y in ((a, b), (a, c)):
                assert np.array_equal(x.src, y.src)
                assert np.array_equal(x.dst, y.dst)
                assert np.array_equal(x.nbytes, y.nbytes)


@SETTINGS
@given(data=st.data())
def test_one_page_requests_take_the_shortcut_and_match_the_general_expansion(
    data: st.DataObject,
) -> None:
    """A request of one slot per pool (a decode step's page) is expanded by a shortcut:
    its bytes match the reference, and its descriptors are the general path's, in order."""
    layout = data.draw(layouts(max_pp=2))
    ref = layout.reference(seed=data.draw(seeds))
    pools = sorted(set(layout.src_slots) & set(layout.dst_slots))
    chosen = data.draw(st.lists(st.sampled_from(pools), min_size=1, unique=True)) if pools else []
    request = {
        pool: (
            np.array([data.draw(st.integers(0, layout.src_slots[pool] - 1))]),
            np.array([data.draw(st.integers(0, layout.dst_slots[pool] - 1))]),
        )
        for pool in chosen
    }
    handoff(ref, request)
    srcs = [r.manifest for r in ref.srcs]
    for rank in ref.dsts:
        for p in coverage(srcs, rank.manifest).plans.values():
            req = for_rank(rank.manifest, request)
            fast = p.expand(req)
            assert fast.origin is not None  # sealed, as every expansion
            assert not fast.src.flags.writeable
            pairs = p.page_pairs(req)
            parts = [_expand_group(g, pairs[g.pool]) for g in p.of_layers(None) if g.pool in pairs]
            count = sum(n for n, _ in parts)
            src, dst, nbytes = (np.zeros(count, dtype=np.uint64) for _ in range(3))
            at = 0
            for n, fill in parts:
                fill(src[at : at + n], dst[at : at + n], nbytes[at : at + n])
                at += n
            assert np.array_equal(fast.src, src)
            assert np.array_equal(fast.dst, dst)
            assert np.array_equal(fast.nbytes, nbytes)
