"""Careless and hostile manifests (issue 9): each case was accepted, hung or crashed before."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from functools import partial

import msgspec
import numpy as np
import pytest

import xferkit as xk
from xferkit.manifest import MAX_AXES, MAX_TP_SIZE
from xferkit.testing.regions import region as synthetic_region

# Loosely typed: these tests hand it wrong types on purpose.
_region: Callable[..., xk.Region] = partial(
    synthetic_region, addr=0x1000, nbytes=128, slot_shape=(64,)
)


def test_from_array_keeps_the_array_alive() -> None:
    """A temporary array must not be freed while its region (and manifest) lives."""
    region = xk.Region.from_array(np.arange(4096, dtype=np.uint8), pool="p", name="a", layer=0)
    owner = region.owner
    assert owner is not None and owner.ctypes.data == region.addr
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is not None  # held by the region
    m = xk.Manifest.build([region])
    del region
    gc.collect()
    assert ref() is not None  # and by the manifest holding the region
    assert m.regions[0].owner is ref()
    # Not part of the wire form: a decoded manifest owns nothing.
    assert xk.Manifest.decode(m.encode()).regions[0].owner is None


def test_read_only_arrays_are_refused() -> None:
    frozen = np.zeros(64, dtype=np.uint8)
    frozen.setflags(write=False)
    with pytest.raises(xk.ManifestError, match="read-only"):
        xk.Region.from_array(frozen, pool="p", name="a", layer=0)
    with pytest.raises(xk.ManifestError, match="read-only"):
        xk.Region.from_array(np.frombuffer(b"x" * 64, dtype=np.uint8), pool="p", name="a", layer=0)


def test_object_arrays_are_refused() -> None:
    with pytest.raises(xk.ManifestError, match="object"):
        xk.Region.from_array(np.empty(8, dtype=object), pool="p", name="a", layer=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer", "0"),
        ("part", 1.0),
        ("layer", True),
        ("addr", None),
        ("pool", 3),
        ("device", None),
        ("slot_shape", "64"),
        ("slot_shape", (64.0,)),
        ("tp_axis", "0"),
        ("tp_groups", 3),
        ("itemsize", 2.5),
        ("axes", "token"),
        ("axes", ("token", 3)),
    ],
)
def test_field_types_are_checked_when_built(field: str, value: object) -> None:
    with pytest.raises(xk.ManifestError, match=field):
        _region(**{field: value})


def test_numpy_integers_are_accepted_as_ints() -> None:
    r = _region(layer=np.int64(3), addr=np.uint64(0x1000))
    assert type(r.layer) is int and r.layer == 3 and type(r.addr) is int
    assert xk.Manifest.build([r]).regions[0].key == ("kv", "k", 3, 0)


def test_a_string_layer_cannot_silently_move_nothing() -> None:
    """Before: layer="0" passed, the planner took it for another PP stage, writes moved nothing."""
    with pytest.raises(xk.ManifestError, match="layer"):
        xk.Region(pool="kv", name="k", layer="0", addr=1, nbytes=2, slot_shape=(1,), itemsize=2)  # type: ignore[arg-type]


def test_a_huge_tp_size_is_refused_at_once() -> None:
    """Before: a 107-byte manifest claiming tp_size 2**63-1 kept decode busy forever."""
    m = xk.Manifest.build([_region(tp_axis=0, tp_global=64 * 4)], tp_rank=0, tp_size=4)
    raw = msgspec.msgpack.decode(m.encode())
    raw["tp_size"] = 2**63 - 1
    t = time.perf_counter()
    with pytest.raises(xk.ManifestError, match="tp_size"):
        xk.Manifest.decode(msgspec.msgpack.encode(raw))
    assert time.perf_counter() - t < 1.0  # no loop per claimed rank
    raw["tp_size"] = MAX_TP_SIZE
    raw["regions"][0]["tp_global"] = 64 * MAX_TP_SIZE
    assert xk.Manifest.decode(msgspec.msgpack.encode(raw)).tp_size == MAX_TP_SIZE


@pytest.mark.parametrize(("rank", "size"), [(0.5, 2), (0, 2.0), ("0", 1), (True, 2)])
def test_tp_rank_and_size_must_be_ints(rank: object, size: object) -> None:
    with pytest.raises(xk.ManifestError, match="tp_"):
        xk.Manifest.build([_region()], tp_rank=rank, tp_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, 3, "regions", _region()])
def test_build_takes_an_iterable_of_regions(bad: object) -> None:
    with pytest.raises(xk.ArgumentError):
        xk.Manifest.build(bad)  # type: ignore[arg-type]
    if not isinstance(bad, xk.Region):
        with pytest.raises(xk.ArgumentError):
            xk.Manifest.build([bad])  # type: ignore[list-item]


def test_tp_groups_must_be_a_sequence() -> None:
    a = np.zeros((4, 6), dtype=np.uint8)
    with pytest.raises(xk.ManifestError, match="tp_groups"):
        xk.Region.from_array(a, pool="p", name="a", layer=0, tp_axis=0, tp_groups="123")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "face",
    [
        {"shape": (4,), "data": (0x1000, False)},  # no typestr
        {"shape": (4,), "typestr": "|u1"},  # no data
        {"shape": "x", "typestr": "|u1", "data": (0x1000, False)},
        {"shape": (4,), "typestr": "??", "data": (0x1000, False)},
    ],
)
def test_malformed_array_interfaces_are_manifest_errors(face: dict) -> None:
    class Fake:
        __array_interface__ = face

    with pytest.raises(xk.ManifestError):
        xk.Region.from_array(Fake(), pool="p", name="a", layer=0)


def test_a_region_ending_at_2_64_does_not_wrap_in_the_overlap_check() -> None:
    """Before: its end wrapped to 0, so an overlapping region passed."""
    top = _region(name="top", addr=2**64 - 128, nbytes=128)
    inside = _region(name="in", addr=2**64 - 64, nbytes=64, slot_shape=(32,))
    assert len(xk.Manifest.build([top])) == 1
    with pytest.raises(xk.ManifestError, match="overlap"):
        xk.Manifest.build([top, inside])


def test_locate_at_the_top_of_the_address_space() -> None:
    m = xk.Manifest.build([_region(name="top", addr=2**64 - 128, nbytes=128)])
    addrs = np.array([2**64 - 128, 2**64 - 1, 2**64 - 64, 0], dtype=np.uint64)
    sizes = np.array([128, 1, 65, 1], dtype=np.uint64)  # the third would wrap past 2**64
    assert m.locate(addrs, sizes).tolist() == [0, 0, -1, -1]
    assert m.first_outside(addrs, sizes) == 2


def test_coverage_costs_the_pieces_not_the_slot_size() -> None:
    """Before: one 64 GiB slot made coverage allocate a per-byte count array (512 GiB)."""
    huge = 64 << 30
    m = xk.Manifest.build([_region(nbytes=huge, slot_shape=(huge // 2,), itemsize=2, addr=1 << 40)])
    t = time.perf_counter()
    cov = xk.coverage([m], m)
    assert cov.sources == (0,) and time.perf_counter() - t < 1.0


def test_a_slot_needing_too_many_pieces_is_refused() -> None:
    """An axis sharded under billions of rows would build a piece table of that size."""
    rows = 1 << 30
    src = xk.Manifest.build(
        [_region(nbytes=rows * 4, slot_shape=(rows, 2), itemsize=2, tp_axis=1)], tp_size=1
    )
    dst = xk.Manifest.build(
        [_region(nbytes=rows * 2, slot_shape=(rows, 1), itemsize=2, tp_axis=1)], tp_size=2
    )
    with pytest.raises(xk.PlanError, match="pieces"):
        xk.plan(src, dst)


@pytest.mark.parametrize("bad", [None, "x", 3])
def test_plan_and_coverage_check_their_arguments(bad: object) -> None:
    m = xk.Manifest.build([_region()])
    with pytest.raises(xk.ArgumentError):
        xk.plan(m, bad)  # type: ignore[arg-type]
    with pytest.raises(xk.ArgumentError):
        xk.plan(bad, m)  # type: ignore[arg-type]
    with pytest.raises(xk.ArgumentError):
        xk.coverage([bad], m)  # type: ignore[list-item]
    with pytest.raises(xk.ArgumentError):
        xk.plan(m, m).expand(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "axes", [("token",) * 2, ("token",), ("token", "head", "dim"), ("token", ""), ()]
)
def test_axes_name_each_axis_once(axes: tuple[str, ...]) -> None:
    """A name twice, a missing or extra name, an empty one: pairing by name would guess."""
    with pytest.raises(xk.ManifestError, match="axes"):
        xk.Manifest.build([_region(nbytes=128, slot_shape=(8, 8), itemsize=2, axes=axes)])


def test_a_slot_of_more_axes_than_numpy_allows_is_refused() -> None:
    """A peer's region of a million unit axes would cost the planner per axis (and per pair of
    axes, where it pairs them by name); numpy stops at 64 axes, so do manifests."""
    shape = (1,) * (MAX_AXES + 1)
    with pytest.raises(xk.ManifestError, match=f"more than {MAX_AXES}"):
        xk.Manifest.build([_region(nbytes=2, slot_shape=shape)])
    names = tuple(f"a{i}" for i in range(MAX_AXES))
    m = xk.Manifest.build([_region(nbytes=2, slot_shape=(1,) * MAX_AXES, axes=names)])
    flipped = xk.Manifest.build(
        [_region(addr=0x9000, nbytes=2, slot_shape=(1,) * MAX_AXES, axes=names[::-1])]
    )
    assert xk.plan(m, flipped).expand({"kv": ([0], [0])}).total_bytes == 2
