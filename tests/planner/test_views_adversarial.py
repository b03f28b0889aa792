"""A careless engine and a hostile peer against named axes and page ratios: every public call
succeeds or raises an XferError naming the culprit, whatever its arguments; what planning
builds from a peer's claims stays bounded; hand-picked corners stay byte-exact."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from xferkit import PAGE_AXIS, Manifest, PlanError, Region, XferError, plan
from xferkit.planner import MAX_PIECES
from xferkit.staging import stage
from xferkit.testing import Reference, RegionSpec, handoff, staged_handoff
from xferkit.testing.regions import region

AXES = (PAGE_AXIS, "head", "dim")


def _region(shape: tuple[int, ...], axes: tuple[str, ...] | None, addr: int, slots: int) -> Region:
    return region(addr=addr, slots=slots, slot_shape=shape, axes=axes)


def _pair(src: Region, dst: Region) -> tuple[Manifest, Manifest]:
    return (
        Manifest.build([src], tp_rank=0, tp_size=1),
        Manifest.build([dst], tp_rank=0, tp_size=1),
    )


def _nhd_to_hnd() -> tuple[Manifest, Manifest]:
    """16-token NHD pages into 64-token HND pages: a destination slot holds four."""
    return _pair(
        _region((16, 8, 4), AXES, 1 << 20, 16),
        _region((8, 64, 4), ("head", PAGE_AXIS, "dim"), 1 << 40, 4),
    )


# -- what a careless engine passes -------------------------------------------------------


@pytest.mark.parametrize("axes", [{PAGE_AXIS, "head"}, {PAGE_AXIS: 0, "head": 1}])
def test_axes_must_be_ordered(axes: object) -> None:
    """A set (or a dict's keys) has no order an engine can rely on: iterated, it depends on
    the process's hash seed, so two ranks could name the same memory NHD and HND and pair
    transposed. ``Region(...)`` refuses it; ``Region.from_array`` must too."""
    with pytest.raises(XferError, match=r"kv/k\[0\]"):
        Region(**{**_kwargs(), "axes": axes})  # type: ignore[arg-type]
    with pytest.raises(XferError, match=r"kv/k\[0\]"):
        Region.from_array(
            np.zeros((4, 16, 8), np.float16),
            pool="kv",
            name="k",
            layer=0,
            axes=axes,  # type: ignore[arg-type]
        )


def _kwargs() -> dict[str, object]:
    return dict(
        pool="kv",
        name="k",
        layer=0,
        addr=1 << 20,
        nbytes=4 * 16 * 8 * 2,
        slot_shape=(16, 8),
        itemsize=2,
    )


@pytest.mark.parametrize("key", [["kv"], {}, np.array(["kv"]), ("kv", ["k"], 0, 0)])
def test_plan_lookups_refuse_unhashable_names(key: object) -> None:
    """``Plan.pages`` / ``describe`` / ``pieces`` take a pool name or a region key: anything
    else is a PlanError, not a TypeError from a dict lookup."""
    p = plan(*_nhd_to_hnd())
    assert p.pages("kv") == (1, 4)
    with contextlib.suppress(XferError):  # or what an unknown name gets: nothing pairs
        assert p.pages(key) is None  # type: ignore[arg-type]
    with contextlib.suppress(XferError):
        assert p.describe(key) == ""  # type: ignore[arg-type]
    with contextlib.suppress(XferError):
        assert not p.pieces(key).src.size  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [-1, 1.5, True, None])
def test_staging_capacities_that_are_not_sizes_are_plan_errors(capacity: object) -> None:
    staged = stage(plan(*_nhd_to_hnd()), descriptor_bytes=1 << 20, force="both")
    with pytest.raises(PlanError, match="capacity"):
        staged.expand({"kv": ([0, 1, 2], [1])}, src_capacity=capacity, dst_capacity=1 << 20)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [2**62, 2**64, 2**80])
def test_staging_capacities_beyond_any_memory_are_all_the_same(capacity: int) -> None:
    """Before: 2**64 and up overflowed numpy (OverflowError) while cutting rounds."""
    staged = stage(plan(*_nhd_to_hnd()), descriptor_bytes=1 << 20, force="both")
    out = staged.expand({"kv": ([0, 1, 2], [1])}, src_capacity=capacity, dst_capacity=capacity)
    assert len(out.rounds) == 1


@pytest.mark.parametrize("base", [-1, 2**64, "x", None, 1.5])
def test_a_round_expands_only_at_staging_addresses(base: object) -> None:
    """``Round.expand`` takes two addresses: anything else is an XferError."""
    staged = stage(plan(*_nhd_to_hnd()), descriptor_bytes=1 << 20, force="both")
    r = staged.expand({"kv": ([0, 1, 2], [1])}, src_capacity=1 << 20, dst_capacity=1 << 20).rounds[
        0
    ]
    with pytest.raises(XferError):
        r.expand(base, 1 << 30)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "request_",
    [
        {"kv": ([0.0], [0])},
        {"kv": ([0, 1, 2, 3, 4], [0])},  # five source pages, one destination slot of four
        {"kv": ([0, 1, 2, 3], [0, 1])},  # the second destination slot would take nothing
        {"kv": ([], [0])},
        {"kv": ([0], [])},
        {"kv": ([0], [0, 0])},
        {"kv": ([16], [0])},
        {"kv": ([0], [4])},
        {"kv": (np.array([2**64 - 1], dtype=np.uint64), [0])},
        {"kv": ([-1], [0])},
        {"kv": ([[0]], [[0]])},
        {"kv": (np.array([0], dtype=object), [0])},
        {"kv": ("ab", [0])},
        {"kv": None},
        {"kv": ([0], [0], [0])},
        {"nope": ([0], [0])},
    ],
)
def test_page_ratio_requests_are_checked_before_anything_is_made(request_: dict) -> None:
    p = plan(*_nhd_to_hnd())
    staged = stage(p, descriptor_bytes=1 << 20, force="staged")
    with pytest.raises(PlanError):
        p.expand(request_)
    with pytest.raises(PlanError):
        staged.expand(request_, src_capacity=1 << 20, dst_capacity=1 << 20)


# -- what a hostile peer claims ----------------------------------------------------------


def test_a_transposition_past_max_pieces_is_refused_before_anything_is_built() -> None:
    """One item a piece (the peer lays the axes out reversed) over 2**22 + items a slot: a
    PlanError naming the region, not 100 MiB of tables."""
    n = 2049  # 2049 * 2048 > MAX_PIECES
    assert n * 2048 > MAX_PIECES
    src, dst = _pair(
        _region((n, 2048), (PAGE_AXIS, "head"), 1 << 20, 1),
        _region((2048, n), ("head", PAGE_AXIS), 1 << 40, 1),
    )
    with pytest.raises(PlanError, match=r"kv/k\[0\].*pieces"):
        plan(src, dst)


def test_a_huge_page_ratio_is_bounded_by_the_pieces_coverage_walks() -> None:
    """A destination claiming slots of 2**23 source pages: coverage would walk 2**23 pages."""
    src, dst = _pair(
        _region((1, 1), (PAGE_AXIS, "head"), 1 << 20, 4),
        _region((1 << 23, 1), (PAGE_AXIS, "head"), 1 << 40, 1),
    )
    with pytest.raises(PlanError, match=r"kv/k\[0\]"):
        plan(src, dst)


# -- corners, byte-exact -----------------------------------------------------------------


@pytest.mark.parametrize("pages", [(1, 64), (64, 1)])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (3, 2), (2, 4)])
def test_one_token_pages_against_sixty_four(
    pages: tuple[int, int], src_tp: int, dst_tp: int
) -> None:
    """Pages of one token on one side, 64 on the other, heads sharded and transposed; one
    long slot filled in part, slots unsorted; direct, then staged one unit a round."""
    specs = [
        RegionSpec(
            pool="kv",
            name=n,
            layer=0,
            shape=(1, 12, 2),
            itemsize=1,
            tp_axis=1,
            axes=AXES,
            src_order=(1, 0, 2),
            src_pages=pages[0],
            dst_pages=pages[1],
        )
        for n in "kv"
    ]
    fine, coarse = [*range(150, 200), *range(0, 30)], [3, 0]
    request = {"kv": (fine, coarse) if pages[1] > 1 else (coarse, fine)}
    ns, nd = (200, 4) if pages[1] > 1 else (4, 200)

    def ref() -> Reference:
        return Reference(
            specs, src_tp=src_tp, dst_tp=dst_tp, src_slots={"kv": ns}, dst_slots={"kv": nd}
        )

    handoff(ref(), request)
    unit = 12 // min(src_tp, dst_tp) * 2  # at most a page's bytes a rank pair moves
    for force in ("staged", "pack", "unpack", "both"):
        staged_handoff(ref(), request, force=force, capacity=unit, descriptor_bytes=1 << 20)  # type: ignore[arg-type]


def test_a_sharded_token_axis_cannot_hold_pages() -> None:
    """Tokens sharded over TP 2 on the source (eight a rank, 16 in all) against 64-token
    pages on the destination: a page ratio needs the token axis whole on each rank."""
    src = Region(
        pool="kv",
        name="k",
        layer=0,
        addr=1 << 20,
        nbytes=8 * 4 * 2 * 4,
        slot_shape=(8, 4),
        itemsize=2,
        tp_axis=0,
        axes=(PAGE_AXIS, "head"),
    )
    dst = _region((64, 4), (PAGE_AXIS, "head"), 1 << 40, 4)
    with pytest.raises(PlanError, match=r"kv/k\[0\]"):
        plan(
            Manifest.build([src], tp_rank=0, tp_size=2), Manifest.build([dst], tp_rank=0, tp_size=1)
        )
