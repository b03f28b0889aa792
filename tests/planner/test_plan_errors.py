"""Every PlanError says what differs; PP skips are not errors; coverage finds holes and double
writes; Plan.expand rejects bad input before producing anything; plans are reusable and coalesce.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import pytest

from xferkit import Descriptors, Manifest, PlanError, Region, coverage, key_label, plan
from xferkit.testing.regions import region as synthetic_region

region = partial(synthetic_region, slots=8, slot_shape=(4, 2, 8), tp_axis=1)


def manifest(*regions: Region, rank: int = 0, size: int = 2) -> Manifest:
    return Manifest.build(regions, tp_rank=rank, tp_size=size)


def raises_naming(*parts: str):
    pattern = "".join(f"(?=.*{re.escape(s)})" for s in parts)
    return pytest.raises(PlanError, match=re.compile(pattern, re.S))


K0 = ("kv", "k", 0, 0)


# -- what differs -----------------------------------------------------------


def test_itemsize_differs() -> None:
    src = manifest(region(itemsize=2))
    dst = manifest(region(itemsize=4))
    with raises_naming(key_label(K0), "itemsize", "2", "4") as info:
        plan(src, dst)
    assert info.value.subject == K0


def test_non_sharded_dims_differ() -> None:
    src = manifest(region(slot_shape=(4, 2, 8)))
    dst = manifest(region(slot_shape=(4, 2, 16)))
    with raises_naming(key_label(K0), "non-sharded dims", "(4, 2, 8)", "(4, 2, 16)"):
        plan(src, dst)


def test_slot_rank_differs() -> None:
    src = manifest(region(slot_shape=(4, 2, 8)))
    dst = manifest(region(slot_shape=(4, 16), tp_axis=0))
    with raises_naming(key_label(K0), "(4, 2, 8)", "(4, 16)"):
        plan(src, dst)


def test_global_size_differs() -> None:
    src = manifest(region(slot_shape=(4, 2, 8)), size=2)  # 4 heads
    dst = manifest(region(slot_shape=(4, 1, 8)), size=2)  # 2 heads
    with raises_naming(key_label(K0), "global size", "4", "2"):
        plan(src, dst)
    # tp_global participates: 2 heads over 4 ranks is the same axis as 1 head x TP 2.
    dst = manifest(region(slot_shape=(4, 1, 8), tp_global=2), rank=3, size=4)
    with raises_naming(key_label(K0), "global size"):
        plan(src, dst)
    # Control: 1 head x TP 2 on the source is that axis; rank 1 holds head 1, as dst rank 3 does.
    srcs = [manifest(region(slot_shape=(4, 1, 8)), rank=r, size=2) for r in (0, 1)]
    assert coverage(srcs, dst).sources == (1,)


def test_region_missing_on_the_destination() -> None:
    src = manifest(region("k"), region("v"))
    dst = manifest(region("k"))
    with raises_naming("kv/v[0]", "missing on the destination"):
        plan(src, dst)


def test_region_missing_on_the_source() -> None:
    src = manifest(region("k"))
    dst = manifest(region("k"), region("v", part=2))
    with raises_naming("kv/v[0]#2", "missing on the source"):
        plan(src, dst)


@pytest.mark.parametrize("empty_side", ["source", "destination"])
def test_region_empty_on_one_side_only(empty_side: str) -> None:
    full = [region("k"), region("temporal", pool="state", slot_shape=(4, 4), tp_axis=0)]
    empty = [region("k"), region("temporal", pool="state", slot_shape=(0, 4), tp_axis=0)]
    src, dst = (full, empty) if empty_side == "destination" else (empty, full)
    src_m, dst_m = manifest(*src), manifest(*dst)
    with raises_naming("state/temporal[0]", "empty", f"on the {empty_side}") as info:
        plan(src_m, dst_m)
    assert info.value.subject == ("state", "temporal", 0, 0)


def test_region_empty_on_both_sides_is_fine() -> None:
    regions = [region("k"), region("temporal", pool="state", slot_shape=(0, 4), tp_axis=0)]
    p = plan(manifest(*regions), manifest(*regions))
    assert p.keys == (K0,)


def test_shard_groups_differ() -> None:
    src = manifest(region("conv", slot_shape=(4, 3), tp_axis=0, tp_groups=(4, 4)))
    dst = manifest(region("conv", slot_shape=(4, 3), tp_axis=0, tp_groups=(2, 6)))
    with raises_naming("kv/conv[0]", "shard groups differ", "(4, 4)", "(2, 6)"):
        plan(src, dst)


@pytest.mark.parametrize("grouped_side", ["source", "destination"])
def test_inexpressible_split(grouped_side: str) -> None:
    grouped = region("conv", slot_shape=(4, 3), tp_axis=0, tp_groups=(4, 4))
    flat = region("conv", slot_shape=(4, 3), tp_axis=0)
    src, dst = (grouped, flat) if grouped_side == "source" else (flat, grouped)
    with raises_naming("kv/conv[0]", "inexpressible", "(4, 4)", f"the {grouped_side} shards"):
        plan(manifest(src), manifest(dst))


def test_groups_against_tp_1_or_replicated_are_expressible() -> None:
    grouped = manifest(region("conv", slot_shape=(4, 3), tp_axis=0, tp_groups=(4, 4)))
    whole = manifest(region("conv", slot_shape=(8, 3), tp_axis=0), size=1)
    replicated = manifest(region("conv", slot_shape=(8, 3), tp_axis=None), size=2)
    for other in (whole, replicated):
        assert not plan(grouped, other).empty
        assert not plan(other, grouped).empty


def test_tp_axis_differs() -> None:
    src = manifest(region(slot_shape=(4, 2, 8), tp_axis=0))
    dst = manifest(region(slot_shape=(4, 2, 8), tp_axis=1))
    with raises_naming(key_label(K0), "sharded along axis 0", "1 on the destination"):
        plan(src, dst)


# -- pipeline parallelism and coverage --------------------------------------


def test_pp_source_without_the_layer_is_skipped_not_an_error() -> None:
    stage0 = manifest(region("k", 0), region("v", 0), size=1)
    stage1 = manifest(region("k", 1), region("v", 1), size=1)
    dst = manifest(region("k", 1), region("v", 1), size=1)
    assert plan(stage0, dst).empty
    assert plan(stage0, dst).keys == ()
    assert set(plan(stage1, dst).keys) == {("kv", "k", 1, 0), ("kv", "v", 1, 0)}
    cov = coverage([stage0, stage1], dst)
    assert cov.sources == (1,)
    assert set(cov.plans) == {1}


def test_coverage_names_a_region_no_source_holds() -> None:
    stage0 = manifest(region("k", 0), size=1)
    dst = manifest(region("k", 0), region("k", 1), size=1)
    with raises_naming("kv/k[1]", "no source") as info:
        coverage([stage0], dst)
    assert info.value.subject == ("kv", "k", 1, 0)


def test_coverage_names_the_hole_when_a_tp_rank_is_missing() -> None:
    rank0 = manifest(region(), rank=0, size=2)  # heads [0, 2) of 4
    dst = manifest(region(slot_shape=(4, 4, 8)), size=1)
    # Missing rank 1: heads [2, 4) of every token row; the first hole is bytes [32, 64).
    with raises_naming(key_label(K0), "[32, 64)", "no source"):
        coverage([rank0], dst)


def test_coverage_detects_double_writes() -> None:
    a = manifest(region("k", 0), rank=0, size=2)
    b = manifest(region("k", 0), rank=0, size=2)  # claims the same rank and layer
    c = manifest(region("k", 0), rank=1, size=2)
    dst = manifest(region("k", 0), rank=0, size=2)
    with raises_naming(key_label(K0), "written 2 times"):
        coverage([a, b, c], dst)


# -- Plan.expand: bad input -------------------------------------------------


@pytest.fixture
def two_pools():
    """Equal TP, KV pool of 8 pages on both sides, state pool of 3 (src) and 5 (dst) slots."""
    src = manifest(
        region("k"), region("v"), region("conv", pool="state", slots=3, slot_shape=(4,), tp_axis=0)
    )
    dst = manifest(
        region("k"), region("v"), region("conv", pool="state", slots=5, slot_shape=(4,), tp_axis=0)
    )
    return plan(src, dst), src, dst


GOOD_KV = (np.array([0, 1]), np.array([2, 3]))


@pytest.mark.parametrize(
    ("slots", "words"),
    [
        ({"kvv": GOOD_KV}, ["'kvv'", "unknown pool"]),
        ({"kv": GOOD_KV, "state": (np.array([0, 1]), np.array([0]))}, ["'state'", "2", "1"]),
        ({"state": (np.array([-1]), np.array([0]))}, ["'state'", "-1", "out of range"]),
        ({"state": (np.array([3]), np.array([0]))}, ["'state'", "source slot 3", "[0, 3)"]),
        ({"state": (np.array([2]), np.array([5]))}, ["'state'", "destination slot 5", "[0, 5)"]),
        ({"state": (np.array([0]), np.array([-2]))}, ["'state'", "-2"]),
        ({"kv": (np.array([0, 1, 2]), np.array([4, 5, 4]))}, ["'kv'", "slot 4", "twice"]),
        ({"kv": (np.array([0.0, 1.0]), np.array([2, 3]))}, ["'kv'", "integer", "float"]),
        ({"kv": (["0", "1"], [2, 3])}, ["'kv'", "integer"]),
        ({"kv": (np.array([True, False]), np.array([2, 3]))}, ["'kv'", "integer"]),
        ({"kv": (np.array([[0, 1]]), np.array([[2, 3]]))}, ["'kv'", "1-D"]),
        ({"kv": (np.array(0), np.array(2))}, ["'kv'", "1-D"]),
        ({"kv": np.array([0, 1, 2])}, ["'kv'", "src_slot_indices"]),
        ({"kv": 5}, ["'kv'"]),
        ({"kv": ([[0], [1, 2]], [2, 3])}, ["'kv'", "source", "1-D integer"]),
        ({"kv": ([0, 1], [[2], [3, 4]])}, ["'kv'", "destination", "1-D integer"]),
    ],
    ids=[
        "unknown-pool",
        "length-mismatch",
        "negative",
        "src-too-large",
        "dst-too-large",
        "dst-negative",
        "duplicate-dst",
        "float",
        "str",
        "bool",
        "2-D",
        "0-D",
        "not-a-pair",
        "not-iterable",
        "ragged-source",
        "ragged-destination",
    ],
)
def test_expand_rejects_bad_input_and_produces_nothing(two_pools, slots, words) -> None:
    p, _, _ = two_pools
    before = p.expand({"kv": GOOD_KV})
    with raises_naming(*words) as info:
        # A valid pool next to the bad one: it must not produce anything either.
        p.expand({"kv": GOOD_KV, **slots} if "kv" not in slots else slots)
    assert info.value.subject in ("kv", "state", "kvv")
    after = p.expand({"kv": GOOD_KV})  # the failed call left the plan unchanged
    assert np.array_equal(before.src, after.src) and np.array_equal(before.dst, after.dst)


def test_slot_counts_are_read_only(two_pools) -> None:
    """Before: ``src_slots``/``dst_slots`` were plain dicts that ``expand`` checks requests
    against, so raising a count let a request name slots past the registered memory."""
    p, _, _ = two_pools
    with pytest.raises(TypeError):
        p.src_slots["state"] = 100  # type: ignore[index]
    with pytest.raises(TypeError):
        p.dst_slots["state"] = 100  # type: ignore[index]
    with pytest.raises(AttributeError):
        p.src_slots = {"state": 100}  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.dst_slots = {"state": 100}  # type: ignore[misc]
    assert dict(p.src_slots) == {"kv": 8, "state": 3}
    assert dict(p.dst_slots) == {"kv": 8, "state": 5}
    with raises_naming("'state'", "source slot 3", "out of range [0, 3)"):
        p.expand({"state": ([3], [4])})


def test_expand_accepts_empty_and_missing_pools(two_pools) -> None:
    p, _, _ = two_pools
    assert len(p.expand({})) == 0
    assert len(p.expand({"kv": ([], [])})) == 0
    assert len(p.expand({"kv": (np.zeros(0, np.int64), np.zeros(0, np.uint32))})) == 0
    # Only the requested pool moves.
    d = p.expand({"state": ([2], [4])})
    assert len(d) == 1 and d.total_bytes == 4 * 2


def test_source_slots_may_repeat_but_do_not_coalesce(two_pools) -> None:
    p, src, dst = two_pools
    d = p.expand({"kv": ([3, 3], [0, 1])})
    # Each region: slot 3 copied twice, into destination pages 0 and 1: two descriptors.
    assert len(d) == 4
    for key in (K0, ("kv", "v", 0, 0)):
        s, t = src.region(key), dst.region(key)
        mine = np.flatnonzero((d.dst >= t.addr) & (d.dst < t.addr + t.nbytes))
        assert sorted(d.dst[mine].tolist()) == [t.addr, t.addr + t.slot_nbytes]
        assert d.src[mine].tolist() == [s.addr + 3 * s.slot_nbytes] * 2


# -- reuse and coalescing ---------------------------------------------------


def test_plan_is_reusable(two_pools) -> None:
    p, _, _ = two_pools
    req = {"kv": (np.array([5, 1, 2]), np.array([0, 6, 7])), "state": ([0, 2], [1, 3])}
    a, b = p.expand(req), p.expand(req)
    for x, y in ((a.src, b.src), (a.dst, b.dst), (a.nbytes, b.nbytes)):
        assert np.array_equal(x, y)
    assert isinstance(a, Descriptors) and a is not b


def test_equal_tp_contiguous_pages_give_one_descriptor_per_region(two_pools) -> None:
    p, src, dst = two_pools
    pages = 6
    d = p.expand({"kv": (np.arange(1, 1 + pages), np.arange(2, 2 + pages))})
    assert len(d) == 2  # k and v
    for key in (K0, ("kv", "v", 0, 0)):
        s, t = src.region(key), dst.region(key)
        i = int(np.flatnonzero(d.dst == t.addr + 2 * t.slot_nbytes)[0])
        assert int(d.src[i]) == s.addr + 1 * s.slot_nbytes
        assert int(d.nbytes[i]) == pages * s.slot_nbytes


def test_shuffled_consecutive_pairs_still_coalesce(two_pools) -> None:
    p, _, _ = two_pools
    src, dst = np.arange(1, 7), np.arange(2, 8)
    perm = np.array([4, 0, 5, 2, 1, 3])
    a = p.expand({"kv": (src, dst)})
    b = p.expand({"kv": (src[perm], dst[perm])})
    assert len(b) == 2
    assert np.array_equal(a.src, b.src) and np.array_equal(a.dst, b.dst)
    assert np.array_equal(a.nbytes, b.nbytes)


def test_runs_break_where_either_side_jumps(two_pools) -> None:
    p, _, _ = two_pools
    # Pairs sorted by destination: (0,0) (1,1) | (5,2) (6,3) | (7,5): breaks at a source
    # jump (1 -> 5) and a destination jump (3 -> 5): 3 runs per region.
    d = p.expand({"kv": ([0, 1, 5, 6, 7], [0, 1, 2, 3, 5])})
    assert len(d) == 3 * 2
    slot = 4 * 2 * 8 * 2
    assert sorted(d.nbytes.tolist()) == [slot] * 2 + [2 * slot] * 4
