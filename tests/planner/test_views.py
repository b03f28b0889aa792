"""Named axes and page ratios: NHD on one side and HND on the other, pages of 16 tokens on
one side and 64 on the other, byte-exact against the reference model (itself checked here
on hand-computed cases), and the PlanErrors for pairs the planner cannot map.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from xferkit import PAGE_AXIS, PlanError, coverage, plan
from xferkit.staging import stage
from xferkit.testing import Rank, Reference, RegionSpec, handoff, requested_bytes, staged_handoff
from xferkit.testing.reference import page_pairs

AXES = (PAGE_AXIS, "head", "dim")
ORDERS = {"NHD": (0, 1, 2), "HND": (1, 0, 2)}
HEADS, DIM, PAGE = 8, 8, 16  # PAGE: tokens of the smaller page


def llama(
    src: str,
    dst: str,
    *,
    src_pages: int = 1,
    dst_pages: int = 1,
    heads: int = HEADS,
    layers: int = 2,
) -> list[RegionSpec]:
    """GQA KV ``[page, heads, head_dim]`` sharded on heads, each side in its own layout."""
    return [
        RegionSpec(
            pool="kv",
            name=n,
            layer=layer,
            shape=(PAGE, heads, DIM),
            itemsize=2,
            tp_axis=1,
            axes=AXES,
            src_order=ORDERS[src],
            dst_order=ORDERS[dst],
            src_pages=src_pages,
            dst_pages=dst_pages,
        )
        for layer in range(layers)
        for n in "kv"
    ]


def _both(ref_of: Callable[[], Reference], request: dict) -> None:
    """``handoff``, then ``staged_handoff`` forced through staging two slots a round and as
    the cost model likes, each on a fresh reference."""
    handoff(ref_of(), request)
    ref = ref_of()
    largest = max(r.slot_nbytes for rank in ref.srcs + ref.dsts for r in rank.manifest)
    staged_handoff(ref, request, force="staged", capacity=2 * largest)
    staged_handoff(ref_of(), request, force=None, descriptor_bytes=PAGE * DIM * 2)


# -- the oracle on hand-computed cases ----------------------------------------------------


def test_reference_transposes_nhd_into_hnd() -> None:
    spec = RegionSpec(
        pool="kv", name="k", layer=0, shape=(2, 2), itemsize=1, axes=AXES[:2], dst_order=(1, 0)
    )
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 2}, dst_slots={"kv": 2})
    # Source slot 1 is [[a, b], [c, d]] by (token, head); its HND copy is [[a, c], [b, d]].
    ref.global_src[spec.key][1, ..., 0] = [[1, 2], [3, 4]]
    before = ref.dsts[0].arrays[spec.key].copy()
    got = ref.expected(0, {"kv": ([1], [0])})[spec.key]
    assert got[0, ..., 0].tolist() == [[1, 3], [2, 4]]
    assert np.array_equal(got[1], before[1])
    src, dst = ref.srcs[0].manifest.regions[0], ref.dsts[0].manifest.regions[0]
    assert src.axes == (PAGE_AXIS, "head") and dst.axes == ("head", PAGE_AXIS)
    assert src.slot_shape == dst.slot_shape == (2, 2)


def test_reference_pairs_pages_in_order_and_keeps_the_unused_block() -> None:
    """Three source slots of one token into two destination slots of two: src 2, 0 fill
    destination 1, src 1 the first half of destination 0, whose second half keeps its bytes."""
    spec = RegionSpec(
        pool="kv", name="k", layer=0, shape=(1, 2), itemsize=1, axes=AXES[:2], dst_pages=2
    )
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 3}, dst_slots={"kv": 2})
    ref.global_src[spec.key][..., 0] = [[[10, 11]], [[20, 21]], [[30, 31]]]
    before = ref.dsts[0].arrays[spec.key].copy()
    assert before.shape == (2, 2, 2, 1)
    request = {"kv": ([2, 0, 1], [1, 0])}
    got = ref.expected(0, request)[spec.key][..., 0]
    assert got[1].tolist() == [[30, 31], [10, 11]]
    assert got[0, 0].tolist() == [20, 21]
    assert np.array_equal(got[0, 1], before[0, 1, :, 0])
    assert requested_bytes(ref, 0, request) == 3 * 2
    assert [a.tolist() for a in page_pairs(spec, [2, 0, 1], [1, 0])] == [
        [2, 0, 1],
        [0, 0, 0],
        [1, 1, 0],
        [0, 1, 0],
    ]


def test_reference_splits_a_coarse_source_slot_over_fine_destinations() -> None:
    spec = RegionSpec(
        pool="kv", name="k", layer=0, shape=(1, 1), itemsize=1, axes=AXES[:2], src_pages=2
    )
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 2}, dst_slots={"kv": 4})
    ref.global_src[spec.key][..., 0, 0] = [[1, 2], [3, 4]]
    before = ref.dsts[0].arrays[spec.key][..., 0, 0].copy()
    got = ref.expected(0, {"kv": ([1, 0], [3, 0, 2])})[spec.key][..., 0, 0]
    assert got[:, 0].tolist() == [4, before[1, 0], 1, 3]


def test_reference_shards_reordered_axes_and_names_them_per_side() -> None:
    """4 KV heads over 8 decode ranks (each holds one head, two ranks share it), HND there."""
    spec = llama("NHD", "HND", heads=4, layers=1)[0]
    ref = Reference([spec], src_tp=2, dst_tp=8, src_slots={"kv": 2}, dst_slots={"kv": 2})
    src, dst = ref.srcs[1].manifest.regions[0], ref.dsts[5].manifest.regions[0]
    assert (src.slot_shape, src.tp_axis, src.tp_global, src.axes) == ((PAGE, 2, DIM), 1, None, AXES)
    assert (dst.slot_shape, dst.tp_axis, dst.tp_global) == ((1, PAGE, DIM), 0, 4)
    assert dst.axes == ("head", PAGE_AXIS, "dim")
    want = ref.global_src[spec.key][1][:, 2]  # rank 5 of 8 holds head 5 * 4 // 8 = 2
    assert np.array_equal(ref.expected(5, {"kv": ([1], [0])})[spec.key][0, 0], want)


@pytest.mark.parametrize(
    ("pages", "n_src", "n_dst"),
    [((1, 4), 8, 3), ((1, 4), 4, 2), ((4, 1), 2, 9), ((1, 1), 2, 3), ((1, 4), 0, 1)],
)
def test_reference_refuses_counts_that_do_not_pair(
    pages: tuple[int, int], n_src: int, n_dst: int
) -> None:
    spec = llama("NHD", "NHD", src_pages=pages[0], dst_pages=pages[1])[0]
    with pytest.raises(ValueError, match=re.escape("kv/k[0]")):
        page_pairs(spec, range(n_src), range(n_dst))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"axes": ("a", "a")},
        {"axes": ("a",)},
        {"axes": None, "dst_order": (1, 0)},
        {"axes": ("a", "b"), "src_order": (0, 0)},
        {"axes": ("a", "b"), "dst_pages": 2},  # no token axis
        {"axes": (PAGE_AXIS, "b"), "tp_axis": 0, "dst_pages": 2},  # token axis sharded
        {"axes": (PAGE_AXIS, "b"), "src_pages": 2, "dst_pages": 3},
    ],
)
def test_region_spec_refuses_what_the_model_cannot_describe(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=re.escape("kv/k[0]")):
        RegionSpec(pool="kv", name="k", layer=0, shape=(2, 2), **kwargs)


# -- layouts: NHD on one side, HND on the other ---------------------------------------------

REQUEST = {"kv": (np.array([5, 1, 2, 3, 7, 0]), np.array([0, 7, 6, 2, 4, 5]))}
TPS = [(4, 8), (8, 4), (1, 1)]


@pytest.mark.parametrize(("src_tp", "dst_tp"), TPS)
@pytest.mark.parametrize(("src", "dst"), [("NHD", "HND"), ("HND", "NHD")])
def test_nhd_and_hnd_pair_by_name(src: str, dst: str, src_tp: int, dst_tp: int) -> None:
    slots = {"kv": 8}

    def ref() -> Reference:
        return Reference(
            llama(src, dst), src_tp=src_tp, dst_tp=dst_tp, src_slots=slots, dst_slots=slots
        )

    _both(ref, REQUEST)


def test_one_side_unnamed_pairs_by_position() -> None:
    """A source naming its axes and a destination that does not: today's positional pairing."""
    named = llama("NHD", "NHD")
    unnamed = [msgspec.structs.replace(s, axes=None) for s in named]
    ref = Reference(unnamed, src_tp=2, dst_tp=4, src_slots={"kv": 8}, dst_slots={"kv": 8})
    ref.srcs = [
        Rank(named, tp_rank=t, tp_size=2, pp_stage=0, fill=ref.global_src) for t in range(2)
    ]
    assert ref.srcs[0].manifest.regions[0].axes == AXES
    assert ref.dsts[0].manifest.regions[0].axes is None
    handoff(ref, REQUEST)


# -- pages of 16 tokens on one side, 64 on the other ----------------------------------------

# 16 -> 64: seven source pages into two destination pages, the second filled in part.
SMALL_TO_LARGE = {"kv": ([3, 4, 5, 6, 7, 8, 0], [2, 0])}
# 64 -> 16: two source pages split over seven destination pages, the second read in part.
LARGE_TO_SMALL = {"kv": ([3, 0], [9, 10, 11, 12, 1, 2, 3])}
LAYOUTS = [("NHD", "NHD"), ("HND", "HND"), ("NHD", "HND"), ("HND", "NHD")]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 8), (8, 4), (2, 4), (1, 1)])
@pytest.mark.parametrize(("src", "dst"), LAYOUTS)
@pytest.mark.parametrize("small_to_large", [True, False])
def test_pages_of_16_and_64_tokens(
    src: str, dst: str, src_tp: int, dst_tp: int, small_to_large: bool
) -> None:
    pages = (1, 4) if small_to_large else (4, 1)
    request = SMALL_TO_LARGE if small_to_large else LARGE_TO_SMALL

    def ref() -> Reference:
        return Reference(
            llama(src, dst, src_pages=pages[0], dst_pages=pages[1]),
            src_tp=src_tp,
            dst_tp=dst_tp,
            src_slots={"kv": 16 // pages[0]},
            dst_slots={"kv": 16 // pages[1]},
        )

    _both(ref, request)
    if small_to_large:
        # Destination page 0 takes three source pages: its last 16 tokens keep their bytes.
        r = ref()
        before = [rank.snapshot() for rank in r.dsts]
        handoff(r, request)
        t = ORDERS[dst].index(0)  # the token axis in the destination's memory order
        for rank, old in zip(r.dsts, before, strict=True):
            for key, array in rank.arrays.items():
                assert array.shape[1 + t] == 4 * PAGE
                tail = np.take(array[0], range(3 * PAGE, 4 * PAGE), axis=t)
                assert np.array_equal(tail, np.take(old[key][0], range(3 * PAGE, 4 * PAGE), axis=t))
                head = np.take(array[0], range(3 * PAGE), axis=t)
                assert not np.array_equal(head, np.take(old[key][0], range(3 * PAGE), axis=t))


def test_whole_pages_both_ways_in_any_order() -> None:
    ref = Reference(
        llama("NHD", "HND", dst_pages=4),
        src_tp=4,
        dst_tp=8,
        src_slots={"kv": 12},
        dst_slots={"kv": 3},
    )
    handoff(ref, {"kv": ([8, 9, 10, 11, 0, 1, 2, 3], [1, 2])})


# -- what the planner refuses --------------------------------------------------------------


def _ranks(src: list[RegionSpec], dst: list[RegionSpec]) -> tuple[Rank, Rank]:
    """One source rank and one destination rank, each built from its own specs."""
    fill_src = {s.key: np.zeros((4, *s.side_shape("src"), s.itemsize), np.uint8) for s in src}
    fill_dst = {s.key: np.zeros((4, *s.side_shape("dst"), s.itemsize), np.uint8) for s in dst}
    return (
        Rank(src, tp_rank=0, tp_size=1, pp_stage=0, fill=fill_src),
        Rank(dst, tp_rank=0, tp_size=1, pp_stage=0, fill=fill_dst, side="dst"),
    )


def _refused(src: Rank, dst: Rank, request: dict | None = None) -> PlanError:
    """The PlanError of planning (or, failing that, expanding ``request``)."""
    with pytest.raises(PlanError) as info:
        plan(src.manifest, dst.manifest).expand(request or {})
    return info.value


def test_both_sides_naming_different_axes_is_refused() -> None:
    spec = llama("NHD", "NHD", layers=1)[0]
    other = msgspec.structs.replace(spec, axes=(PAGE_AXIS, "kv_head", "dim"))
    err = _refused(*_ranks([spec], [other]))
    assert "kv/k[0]" in str(err) and "kv_head" in str(err)


def test_pages_that_are_not_multiples_are_refused() -> None:
    """16 tokens on the source, 24 on the destination: neither holds a whole number of the other."""
    spec = llama("NHD", "NHD", layers=1)[0]
    other = msgspec.structs.replace(spec, shape=(24, HEADS, DIM))
    err = _refused(*_ranks([spec], [other]))
    assert "kv/k[0]" in str(err) and "16" in str(err) and "24" in str(err)


def test_counts_that_do_not_pair_are_refused_naming_the_pool() -> None:
    """At 16 -> 64 tokens, 8 source pages fill exactly 2 destination pages, not 3."""
    src, dst = _ranks(*[llama("NHD", "HND", dst_pages=4)] * 2)
    p = plan(src.manifest, dst.manifest)
    with pytest.raises(PlanError, match="'kv'") as info:
        p.expand({"kv": (np.arange(8) % 4, [0, 1, 2])})
    assert "8" in str(info.value) and "3" in str(info.value)
    # A pool of two source pages cannot leave a destination page empty either.
    with pytest.raises(PlanError, match="'kv'"):
        p.expand({"kv": ([0, 1], [0, 1])})
    # And coverage agrees that the ranks map (the request is what was wrong).
    assert tuple(coverage([src.manifest], dst.manifest).sources) == (0,)


def test_a_pool_mixing_a_page_ratio_and_an_unpaged_region_is_refused() -> None:
    kv = llama("NHD", "NHD", dst_pages=4, layers=1)
    flat = RegionSpec(pool="kv", name="scale", layer=0, shape=(HEADS,), itemsize=4)
    src, dst = _ranks([*kv, flat], [*kv, flat])
    err = _refused(src, dst, {"kv": ([0, 1, 2, 3], [0])})
    assert "kv/scale[0]" in str(err) and "'kv'" in str(err)


# -- corners the properties found ----------------------------------------------------------


def test_a_replicated_region_whose_first_axis_is_the_token_axis() -> None:
    """Replicated on both sides, ``token`` first: two source pages fill one destination page."""
    spec = RegionSpec(
        pool="kv", name="k", layer=0, shape=(1, 2), itemsize=1, axes=AXES[:2], dst_pages=2
    )
    ref = Reference([spec], src_tp=1, dst_tp=2, src_slots={"kv": 3}, dst_slots={"kv": 2})
    handoff(ref, {"kv": ([2, 0, 1], [1, 0])})


def test_named_scalar_slots() -> None:
    """A slot of one item whose (zero) axes are named: nothing to reorder, one byte run."""
    spec = RegionSpec(pool="state", name="t", layer=0, shape=(), itemsize=4, axes=())
    ref = Reference([spec], src_tp=2, dst_tp=1, src_slots={"state": 3}, dst_slots={"state": 3})
    handoff(ref, {"state": ([2, 0], [0, 1])})


@pytest.mark.parametrize(("src_tp", "dst_tp", "pages"), [(4, 8, (4, 1)), (8, 4, (1, 4))])
def test_one_head_a_rank_hnd_pages_move_in_one_descriptor_a_region(
    src_tp: int, dst_tp: int, pages: tuple[int, int]
) -> None:
    """HND with 8 KV heads: the side at TP 8 holds one head, so its 16-token pages are
    contiguous ``[16, dim]`` blocks and four consecutive ones are one head's 64 tokens of
    the other side: one descriptor per region and rank pair, not one per page."""
    ref = Reference(
        llama("HND", "HND", src_pages=pages[0], dst_pages=pages[1]),
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots={"kv": 16 // pages[0]},
        dst_slots={"kv": 16 // pages[1]},
    )
    coarse, fine = [3], [4, 5, 6, 7]
    request = {"kv": (coarse, fine) if pages[0] > 1 else (fine, coarse)}
    counts = handoff(ref, request)
    regions = 4
    for per_src in counts.values():
        assert all(n == regions for n in per_src.values()), counts


@pytest.mark.parametrize("stages", ["source", "destination"])
def test_a_rank_pair_without_the_paged_pool_moves_nothing_of_it(stages: str) -> None:
    """Split over two stages, the paged pool ``kv`` lives on one: the other source stage
    (or the destination stage whose only ``kv`` region is empty) gets the whole request,
    ``kv`` included, and must move nothing of it rather than refuse its counts."""
    kv = llama("NHD", "HND", dst_pages=4, layers=2)
    if stages == "destination":
        kv = [msgspec.structs.replace(s, shape=(PAGE, HEADS, 0)) if s.layer == 0 else s for s in kv]
    state = RegionSpec(pool="state", name="t", layer=0, shape=(HEADS, 4), itemsize=2, tp_axis=0)
    ref = Reference(
        [state, *(s for s in kv if s.layer == 1 or stages == "destination")],
        src_tp=2,
        dst_tp=2,
        src_slots={"kv": 8, "state": 2},
        dst_slots={"kv": 2, "state": 2},
        src_pp=2 if stages == "source" else 1,
        dst_pp=2 if stages == "destination" else 1,
    )
    handoff(ref, {"kv": ([0, 1, 2, 3, 4], [1, 0]), "state": ([1], [0])})


@pytest.mark.parametrize(
    ("layout", "pages", "path"),
    [("HND", (1, 4), "pack"), ("HND", (4, 1), "unpack"), ("NHD", (1, 4), "pack")],
)
def test_short_pages_gathered_into_a_long_one_send_one_wire_copy_a_long_page(
    layout: str, pages: tuple[int, int], path: str
) -> None:
    """Equal TP 8 -> 8, pages of 16 tokens on one side and 64 on the other, random slots: one
    piece a short page, so four wire descriptors a long page direct. Where a descriptor costs
    more than copying a long page, the cost model stages the short pages on their side so that
    the wire copies join into one a long page; where it costs little, it stays direct."""

    def ref_of() -> Reference:
        specs = llama(layout, layout, src_pages=pages[0], dst_pages=pages[1], layers=1)
        return Reference(specs, src_tp=8, dst_tp=8, src_slots={"kv": 32}, dst_slots={"kv": 32})

    long_pages = [3, 9, 1, 14, 7, 20]  # none consecutive: each is its own wire copy
    short = np.random.default_rng(0).permutation(32)[:24].tolist()
    request = {"kv": (long_pages, short) if pages[0] > 1 else (short, long_pages)}
    ref = ref_of()
    p = plan(ref.srcs[0].manifest, ref.dsts[0].manifest)
    # A 16-token page of one head is 256 bytes here: a descriptor worth 2,000 bytes is 500
    # a short page when four join, and copying the page costs 1,024 (copy_cost 4).
    costly = dict(descriptor_bytes=2000, copy_cost=4.0)
    assert {r.path for r in stage(p, **costly).routes.values()} == {path}  # type: ignore[arg-type]
    cheap = stage(p, descriptor_bytes=200, copy_cost=4.0)
    assert {r.path for r in cheap.routes.values()} == {"direct"}
    regions = 2
    direct = handoff(ref_of(), request)
    staged = staged_handoff(ref_of(), request, force=None, **costly)  # type: ignore[arg-type]
    assert set(direct) == set(staged) == set(range(8))
    for di in direct:
        assert direct[di] == {di: 24 * regions}, direct[di]
        assert staged[di] == {di: 6 * regions}, staged[di]
