"""Staged routes (pack / unpack / both) checked byte for byte against the reference model.

Every layout and TP pair the planner's property tests draw, with staging
forced on or chosen by the cost model, through rounds cut at random staging
capacities: each destination equals the reference, no byte lands twice, no
round overflows its staging, and the cost model keeps equal TP and HND direct.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit import ArgumentError, PlanError, coverage, plan, staging
from xferkit.staging import PATHS, Force, StagedPlan, stage
from xferkit.testing import (
    Reference,
    RegionSpec,
    for_rank,
    layouts,
    slot_requests,
    staged_handoff,
)
from xferkit.testing.strategies import INTERESTING_TP

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORCES: st.SearchStrategy[Force] = st.sampled_from([None, "staged", *PATHS])


def _largest_slot(ref: Reference) -> int:
    return max((r.slot_nbytes for rank in ref.dsts + ref.srcs for r in rank.manifest), default=1)


@SETTINGS
@given(data=st.data())
def test_staged_handoff_matches_reference(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    ref = layout.reference(seed=data.draw(st.integers(0, 2**32 - 1)))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    capacity = _largest_slot(ref) * data.draw(st.integers(1, 4)) + data.draw(st.integers(0, 64))
    staged_handoff(
        ref,
        request,
        force=data.draw(FORCES),
        descriptor_bytes=data.draw(st.integers(0, 1 << 16)),
        capacity=capacity,
    )


@settings(SETTINGS, max_examples=50)
@given(data=st.data())
def test_unequal_tp_every_region_sharded(data: st.DataObject) -> None:
    pairs = st.sampled_from([p for p in INTERESTING_TP if p[0] != p[1]])
    layout = data.draw(layouts(max_pp=1, tp=pairs, empty=False, sharded=True))
    ref = layout.reference(seed=data.draw(st.integers(0, 2**32 - 1)))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    staged_handoff(ref, request, force=data.draw(FORCES), capacity=_largest_slot(ref))


@settings(SETTINGS, max_examples=50)
@given(data=st.data())
def test_staged_handoff_with_named_axes_and_page_ratios(data: st.DataObject) -> None:
    """Per-side axis orders and page ratios, staging forced or chosen by the cost model,
    staging from one slot's worth upwards (several rounds now and then)."""
    tp = st.sampled_from([(4, 8), (8, 4), (3, 2), (2, 3), (1, 1), (2, 2), (1, 4), (4, 1)])
    layout = data.draw(layouts(max_pp=1, tp=tp, views=True))
    ref = layout.reference(seed=data.draw(st.integers(0, 2**32 - 1)))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots, layout.pages))
    capacity = _largest_slot(ref) * data.draw(st.integers(1, 3)) + data.draw(st.integers(0, 64))
    staged_handoff(
        ref,
        request,
        force=data.draw(st.sampled_from([None, "staged"])),
        descriptor_bytes=data.draw(st.integers(0, 1 << 12)),
        capacity=capacity,
    )


# -- the shapes engines use: NHD and HND pages of a GQA layer set ------------------------

HEADS, DIM, PAGE, PAGES = 8, 32, 16, 12


def _kv(layout: str) -> list[RegionSpec]:
    shape, axis = ((PAGE, HEADS, DIM), 1) if layout == "NHD" else ((HEADS, PAGE, DIM), 0)
    return [
        RegionSpec(pool="kv", name=n, layer=layer, shape=shape, itemsize=2, tp_axis=axis)
        for layer in range(3)
        for n in "kv"
    ]


def _ref(layout: str, src_tp: int, dst_tp: int) -> Reference:
    slots = {"kv": PAGES}
    return Reference(_kv(layout), src_tp=src_tp, dst_tp=dst_tp, src_slots=slots, dst_slots=slots)


REQUEST = {"kv": (np.array([5, 1, 2, 3, 9, 0]), np.array([0, 7, 8, 9, 4, 11]))}


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "paths"),
    [(4, 8, {"pack"}), (8, 4, {"unpack"}), (3, 2, {"unpack", "both"})],
)
def test_nhd_heterogeneous_tp_stages_and_sends_no_more_descriptors_than_equal_tp(
    src_tp: int, dst_tp: int, paths: set[str]
) -> None:
    # A NIC-like cost: a wire descriptor costs more than a row, less than a page.
    ref = _ref("NHD", src_tp, dst_tp)
    srcs = [r.manifest for r in ref.srcs]
    routes = [
        route
        for d in ref.dsts
        for p in coverage(srcs, d.manifest).plans.values()
        for route in stage(p, descriptor_bytes=PAGE * DIM).routes.values()
    ]
    assert {r.path for r in routes} == paths
    assert all("per wire descriptor" in r.why for r in routes)
    staged = staged_handoff(ref, REQUEST, force=None, descriptor_bytes=PAGE * DIM)
    tp = max(src_tp, dst_tp)  # equal TP at the larger size: as many ranks, as many pages
    equal = staged_handoff(_ref("NHD", tp, tp), REQUEST, force="direct")
    total = sum(n for per_dst in staged.values() for n in per_dst.values())
    assert total <= sum(n for per_dst in equal.values() for n in per_dst.values())


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_a_pages_rows_that_follow_on_in_staging_and_in_the_slot_are_copied_as_one(
    src_tp: int, dst_tp: int
) -> None:
    """NHD at TP 2 -> 4, staged both sides: a decode page's rows hold its two heads and lie in
    order, as they do in staging, so the unpack copies the page at once; the pack gathers
    half of each source row, one copy a row (and the other way round at 4 -> 2). Before,
    both sides copied one row at a time: 16 copies of a page where 1 (5.5 against 6.9 GB/s
    in ``bench_copier.py``'s ``pages`` rows)."""
    ref = _ref("NHD", src_tp, dst_tp)
    pages = len(REQUEST["kv"][0]) * 6  # per page of the request, 3 layers of k and v
    sources = max(1, src_tp // dst_tp)  # the prefill ranks decode rank 0 reads
    dst = ref.dsts[0].manifest
    copies = {"pack": 0, "unpack": 0}
    for src in ref.srcs[:sources]:
        staged = stage(plan(src.manifest, dst), descriptor_bytes=1 << 20, force="both")
        (only,) = staged.expand(REQUEST, src_capacity=1 << 30, dst_capacity=1 << 30).rounds
        got = only.expand(1 << 40, 1 << 41)
        copies["pack"] += len(got.pack)
        copies["unpack"] += len(got.unpack)
    whole, rows = pages * sources, pages * sources * PAGE
    assert copies == (
        {"pack": rows, "unpack": whole} if src_tp < dst_tp else {"pack": whole, "unpack": rows}
    )
    staged_handoff(ref, REQUEST, force="both", descriptor_bytes=1 << 20)  # bytes exact


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 2), (8, 8), (4, 8), (8, 4)])
def test_one_piece_per_page_is_priced_like_every_group(src_tp: int, dst_tp: int) -> None:
    """Equal TP (and HND, a head's rows contiguous) moves one piece per page: direct where a
    descriptor costs less than copying the page twice, staged on both sides where it costs
    more (a page's wire copies then join into one). Before, such a group was kept direct
    whatever the driver declared."""
    for layout in ("HND", "NHD") if src_tp == dst_tp else ("HND",):
        ref = _ref(layout, src_tp, dst_tp)
        p = plan(ref.srcs[0].manifest, ref.dsts[0].manifest)
        cheap = stage(p, descriptor_bytes=1)
        assert {r.path for r in cheap.routes.values()} == {"direct"} and not cheap.staged
        dear = stage(p, descriptor_bytes=1 << 20)
        assert {r.path for r in dear.routes.values()} == {"both"}
        staged_handoff(ref, REQUEST, force=None, descriptor_bytes=1 << 20)  # bytes exact


@pytest.mark.parametrize(
    ("driver", "tokens", "path"),
    [
        ("loopback", 16, "direct"),
        ("nixl", 16, "direct"),
        ("mooncake", 16, "both"),  # 16 KiB pages: 60,000 per descriptor, 2 x 0.33 per byte
        ("mooncake", 128, "direct"),  # 128 KiB pages: copying twice costs more
    ],
)
def test_equal_tp_on_each_drivers_declared_costs(driver: str, tokens: int, path: str) -> None:
    """Llama-70B KV pages (per rank 4 of 8 heads of 128, bf16) at equal TP, priced with what
    each driver declares: on Mooncake over TCP, small pages go staged (it moved equal TP on
    16 KiB pages at 0.59 GB/s against 1.22 GB/s for a staged request of the same size)."""
    specs = [
        RegionSpec(pool="kv", name=n, layer=0, shape=(tokens, 8, 128), tp_axis=1) for n in "kv"
    ]
    ref = Reference(specs, src_tp=2, dst_tp=2, src_slots={"kv": 4}, dst_slots={"kv": 4})
    assert _declared_paths(ref, driver) == {path}


def test_a_request_four_times_the_staging_runs_in_rounds_within_it() -> None:
    ref = _ref("NHD", 4, 8)
    p = stage(plan(ref.srcs[0].manifest, ref.dsts[0].manifest), descriptor_bytes=4096)
    unit = PAGE * DIM * 2  # one head of a page
    everything = {"kv": (np.arange(PAGES), np.arange(PAGES))}
    need = 6 * PAGES * unit  # six regions
    out = p.expand(everything, src_capacity=need // 4, dst_capacity=need // 4)
    assert len(out.rounds) == 4
    assert max(out.src_bytes, out.dst_bytes) <= need // 4
    staged_handoff(ref, everything, force=None, capacity=need // 4)


def test_staging_smaller_than_one_slot_names_the_region() -> None:
    ref = _ref("NHD", 4, 8)
    p = stage(plan(ref.srcs[0].manifest, ref.dsts[0].manifest), descriptor_bytes=4096, force="both")
    with pytest.raises(PlanError, match=r"cannot hold one slot of region group kv/k\[0\] ") as info:
        p.expand(REQUEST, src_capacity=100, dst_capacity=1 << 20)
    assert info.value.subject == ("kv", "k", 0, 0)  # the label in the text, the key as subject


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"descriptor_bytes": -1}, "descriptor_bytes"),
        ({"descriptor_bytes": 1.5}, "descriptor_bytes"),
        ({"descriptor_bytes": 1, "force": "sideways"}, "force"),
        ({"descriptor_bytes": 1, "copy_cost": 0}, "copy_cost"),
        ({"descriptor_bytes": 1, "copy_cost": "1"}, "copy_cost"),
    ],
)
def test_stage_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    ref = _ref("NHD", 4, 8)
    with pytest.raises(PlanError, match=match):
        stage(plan(ref.srcs[0].manifest, ref.dsts[0].manifest), **kwargs)
    with pytest.raises(ArgumentError, match="takes a Plan"):
        stage("plan", descriptor_bytes=1)  # type: ignore[arg-type]


def test_expand_refuses_bad_capacities_and_requests() -> None:
    ref = _ref("NHD", 4, 8)
    p = stage(plan(ref.srcs[0].manifest, ref.dsts[0].manifest), descriptor_bytes=4096)
    with pytest.raises(PlanError, match="src_capacity"):
        p.expand(REQUEST, src_capacity=-1, dst_capacity=1)
    with pytest.raises(ArgumentError, match="pool -> "):
        p.expand(None, src_capacity=1, dst_capacity=1)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="unknown pool"):
        p.expand({"nope": ([0], [0])}, src_capacity=1 << 20, dst_capacity=1 << 20)


def test_a_costly_local_copy_prefers_one_copy_and_a_cheap_one_two() -> None:
    """With copies dearer than the wire (NIXL on host memory) 4 -> 8 NHD packs on the source
    alone; with copies cheaper than a descriptor's worth (Mooncake over TCP) it stages both."""
    ref = _ref("NHD", 4, 8)
    p = plan(ref.srcs[0].manifest, ref.dsts[0].manifest)
    unit = PAGE * DIM * 2
    dear = stage(p, descriptor_bytes=unit, copy_cost=2.4).routes
    cheap = stage(p, descriptor_bytes=4 * unit, copy_cost=0.4).routes
    assert {r.path for r in dear.values()} == {"pack"}
    assert {r.path for r in cheap.values()} == {"both"}
    assert "2.4 per copied byte" in next(iter(dear.values())).why


def _chunks(data: st.DataObject) -> tuple[Reference, list[tuple[StagedPlan, dict]]]:
    """A drawn layout's reference and, for a drawn request, each (staged plan, chunk) pair:
    one per destination rank and source it needs, the route forced or the cost model's."""
    layout = data.draw(layouts())
    ref = layout.reference(seed=data.draw(st.integers(0, 2**32 - 1)))
    request = data.draw(slot_requests(layout.src_slots, layout.dst_slots))
    force = data.draw(FORCES)
    srcs = [r.manifest for r in ref.srcs]
    chunks = []
    for rank in ref.dsts:
        wanted = for_rank(rank.manifest, request)
        cov = coverage(srcs, rank.manifest)
        for si in cov.sources:
            chunks.append((stage(cov.plans[si], descriptor_bytes=4096, force=force), wanted))
    return ref, chunks


@SETTINGS
@given(data=st.data())
def test_a_chunk_that_fits_its_staging_is_one_round_copying_what_the_greedy_cut_does(
    data: st.DataObject,
) -> None:
    """The one-round cut (in plain integers) against the greedy cut run on the same chunk:
    the same staging sizes and, placed at the same bases, the same copies."""
    _, chunks = _chunks(data)
    for staged, wanted in chunks:
        one = staged.expand(wanted, src_capacity=1 << 40, dst_capacity=1 << 40).rounds
        with mock.patch.object(staging, "_rounds", staging._greedy):
            cut = staged.expand(wanted, src_capacity=1 << 40, dst_capacity=1 << 40).rounds
        assert len(one) == len(cut) <= 1
        for a, b in zip(one, cut, strict=True):
            assert (a.src_bytes, a.dst_bytes) == (b.src_bytes, b.dst_bytes)
            copies = zip(a.expand(1 << 30, 1 << 40), b.expand(1 << 30, 1 << 40), strict=True)
            for x, y in copies:
                assert np.array_equal(x.src, y.src) and np.array_equal(x.dst, y.dst)
                assert np.array_equal(x.nbytes, y.nbytes)


@SETTINGS
@given(data=st.data())
def test_each_side_computes_its_own_copies_as_the_whole_round_would(data: st.DataObject) -> None:
    """``only="send"`` gives the whole round's pack and wire copies and no unpack ones;
    ``only="unpack"`` its unpack copies alone (a Session's source and destination each
    compute their own half)."""
    ref, chunks = _chunks(data)
    capacity = _largest_slot(ref) * data.draw(st.integers(1, 4))
    for staged, wanted in chunks:
        for r in staged.expand(wanted, src_capacity=capacity, dst_capacity=capacity).rounds:
            whole = r.expand(1 << 30, 1 << 40)
            send = r.expand(1 << 30, 1 << 40, only="send")
            unpack = r.expand(1 << 30, 1 << 40, only="unpack")
            assert send.pack == whole.pack and send.wire == whole.wire
            assert unpack.unpack == whole.unpack
            assert not len(send.unpack) and not len(unpack.pack) and not len(unpack.wire)


@pytest.mark.parametrize("only", ["wire", np.array(["send", "unpack"]), ["send"], 1])
def test_a_round_refuses_an_unknown_side(only: object) -> None:
    """An array used to escape as numpy's ValueError (its truth is ambiguous)."""
    ref = _ref("NHD", 4, 8)
    p = stage(plan(ref.srcs[0].manifest, ref.dsts[0].manifest), descriptor_bytes=4096, force="both")
    (r,) = p.expand(REQUEST, src_capacity=1 << 20, dst_capacity=1 << 20).rounds
    with pytest.raises(PlanError, match="only must be None, 'send' or 'unpack', not "):
        r.expand(0, 0, only=only)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("driver", "path"),
    [
        ("loopback", "pack"),  # 6,000 per descriptor across processes: 16 per page cost more
        ("nixl", "both"),
        ("mooncake", "both"),
    ],
)
def test_heterogeneous_nhd_on_each_drivers_declared_costs(driver: str, path: str) -> None:
    """The engine-shaped load's pages (Llama-70B, 16 tokens, NHD) at TP 2 -> 4: each decode
    page gathers 16 rows of 512 bytes. Every driver stages them. The loopback declared its
    cost within one process (1,024), and sent them direct, one descriptor a row: under the
    load 0.86-0.98 GB/s, against 1.01-1.18 staged (docs/performance.md)."""
    specs = [RegionSpec(pool="kv", name=n, layer=0, shape=(16, 8, 128), tp_axis=1) for n in "kv"]
    ref = Reference(specs, src_tp=2, dst_tp=4, src_slots={"kv": 4}, dst_slots={"kv": 4})
    assert _declared_paths(ref, driver) == {path}


def _declared_paths(ref: Reference, driver: str) -> set[str]:
    """The routes rank 0's pair takes on what ``driver`` declares."""
    import xferkit as xk

    with xk.open_backend(driver) as b:
        caps = b.capabilities
    p = stage(
        plan(ref.srcs[0].manifest, ref.dsts[0].manifest),
        descriptor_bytes=caps.descriptor_bytes,
        copy_cost=caps.copy_cost,
    )
    return {r.path for r in p.routes.values()}
