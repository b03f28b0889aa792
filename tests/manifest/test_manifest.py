"""Region.from_array, the empty filter, every ManifestError, aligned views, msgspec round trip."""

from __future__ import annotations

import math
import re
from functools import partial

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings

from xferkit import Manifest, ManifestError, Region, key_label
from xferkit.testing import Regions, manifest_regions
from xferkit.testing.regions import region as synthetic_region

KEY = ("kv", "k", 3, 1)
LABEL = key_label(KEY)


region = partial(synthetic_region, addr=0x1000)  # one fixed address: overlaps are the point


def raises_naming(label: str, *more: str):
    """pytest.raises(ManifestError) whose message contains the label and every ``more``."""
    pattern = "".join(f"(?=.*{re.escape(s)})" for s in (label, *more))
    return pytest.raises(ManifestError, match=re.compile(pattern, re.S))


# -- Region.from_array ------------------------------------------------------


def test_from_array_numpy_contiguous() -> None:
    a = np.zeros((5, 3, 4), dtype=np.float16)
    r = Region.from_array(a, pool="kv", name="k", layer=3, part=1, tp_axis=0)
    assert r.key == KEY
    assert r.addr == a.ctypes.data
    assert r.nbytes == a.nbytes == 5 * 3 * 4 * 2
    assert r.slot_shape == (3, 4)
    assert r.itemsize == 2
    assert r.device == "cpu"
    assert r.tp_axis == 0
    assert r.slots == 5
    assert r.slot_nbytes == 24


def test_from_array_contiguous_slice_of_slots_keeps_its_offset() -> None:
    a = np.zeros((6, 4), dtype=np.int32)
    r = Region.from_array(a[2:5], pool="state", name="conv", layer=0)
    assert r.addr == a.ctypes.data + 2 * 4 * 4
    assert r.nbytes == 3 * 4 * 4
    assert r.slot_shape == (4,)


def test_from_array_one_dimensional_has_scalar_slots() -> None:
    a = np.arange(7, dtype=np.uint64)
    r = Region.from_array(a, pool="aux", name="len", layer=0)
    assert r.slot_shape == ()
    assert r.slots == 7
    assert r.slot_nbytes == 8


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::2],  # strided inner axis
        lambda a: a[::2],  # strided slot axis
        lambda a: a.transpose(1, 0, 2),  # axes swapped
        lambda a: np.asfortranarray(a),
    ],
    ids=["inner-stride", "slot-stride", "transposed", "fortran"],
)
def test_from_array_non_contiguous_is_an_error_naming_the_region(view) -> None:
    a = np.zeros((4, 6, 3), dtype=np.float32)
    with raises_naming(LABEL, "contiguous") as info:
        Region.from_array(view(a), pool="kv", name="k", layer=3, part=1)
    assert info.value.subject == KEY


def test_from_array_zero_dimensional_is_an_error() -> None:
    with raises_naming(LABEL, "0-d"):
        Region.from_array(np.array(1.5), pool="kv", name="k", layer=3, part=1)


def test_from_array_unknown_object_is_an_error_naming_the_region() -> None:
    with raises_naming(LABEL, "list"):
        Region.from_array([1, 2, 3], pool="kv", name="k", layer=3, part=1)


class _Device:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class FakeTensor:
    """The torch.Tensor surface from_array may use, backed by a numpy array (no torch)."""

    def __init__(self, array: np.ndarray, device: str = "cuda:1") -> None:
        self._array = array
        self.shape = tuple(array.shape)
        self.device = _Device(device)

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def element_size(self) -> int:
        return self._array.itemsize

    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)

    def numel(self) -> int:
        return self._array.size


def test_from_array_duck_typed_tensor() -> None:
    a = np.zeros((8, 2, 16), dtype=np.uint16)
    r = Region.from_array(FakeTensor(a), pool="kv", name="v", layer=2, tp_axis=0)
    assert r.addr == a.ctypes.data
    assert r.nbytes == a.nbytes
    assert r.slot_shape == (2, 16)
    assert r.itemsize == 2
    assert r.device == "cuda:1"
    assert r.slots == 8


def test_from_array_duck_typed_tensor_device_override_and_non_contiguous() -> None:
    a = np.zeros((8, 4), dtype=np.float32)
    r = Region.from_array(FakeTensor(a), pool="kv", name="v", layer=2, device="cuda:5")
    assert r.device == "cuda:5"
    with raises_naming("kv/v[2]", "contiguous"):
        Region.from_array(FakeTensor(a[:, :2]), pool="kv", name="v", layer=2)


class CudaArray:
    """An object exposing only __cuda_array_interface__ (as cupy / numba arrays do)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, strides=None) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


def test_from_array_cuda_array_interface_with_device_override() -> None:
    obj = CudaArray(0x7F0000001000, (10, 4, 8), "<f2")
    r = Region.from_array(obj, pool="state", name="conv", layer=7, device="cuda:3")
    assert r.addr == 0x7F0000001000
    assert r.nbytes == 10 * 4 * 8 * 2
    assert r.slot_shape == (4, 8)
    assert r.itemsize == 2
    assert r.device == "cuda:3"
    # Without the override (nor __dlpack_device__) the GPU cannot be known: cuda:0 is assumed.
    assert Region.from_array(obj, pool="state", name="conv", layer=7).device == "cuda:0"
    # Explicit C strides are contiguous; anything else is an error naming the region.
    dense = CudaArray(0x7F0000001000, (10, 4, 8), "<f2", strides=(64, 16, 2))
    assert Region.from_array(dense, pool="state", name="conv", layer=7).nbytes == 640
    strided = CudaArray(0x7F0000001000, (10, 4, 8), "<f2", strides=(128, 16, 2))
    with raises_naming("state/conv[7]", "contiguous"):
        Region.from_array(strided, pool="state", name="conv", layer=7, device="cuda:3")


def test_from_array_regions_build_a_manifest() -> None:
    k = np.zeros((4, 2, 8), dtype=np.float16)
    v = np.zeros((4, 2, 8), dtype=np.float16)
    empty = np.zeros((4, 0, 8), dtype=np.float16)
    m = Manifest.build(
        [
            Region.from_array(k, pool="kv", name="k", layer=0, tp_axis=0),
            Region.from_array(empty, pool="kv", name="x", layer=0),
            Region.from_array(v, pool="kv", name="v", layer=0, tp_axis=0),
        ],
        tp_rank=1,
        tp_size=2,
    )
    assert m.keys == (("kv", "k", 0, 0), ("kv", "v", 0, 0))
    assert m.addrs.tolist() == [k.ctypes.data, v.ctypes.data]
    assert m.dropped_keys == {("kv", "x", 0, 0)}


# -- the empty filter -------------------------------------------------------


def test_build_drops_empty_regions_with_a_reason_and_keeps_them_out_of_every_view() -> None:
    kept = region("k", addr=0x1000)
    zero_dim = region("temporal", pool="state", slot_shape=(0, 4, 4), addr=0)
    zero_slots = region("v", slots=0, addr=0x9000)
    m = Manifest.build([zero_dim, kept, zero_slots], tp_rank=0, tp_size=1)

    assert m.regions == (kept,)
    assert [d.key for d in m.dropped] == [zero_dim.key, zero_slots.key]
    reasons = {d.key: d.reason for d in m.dropped}
    assert "(0, 4, 4)" in reasons[zero_dim.key] and "0 bytes" in reasons[zero_dim.key]
    assert "0 bytes" in reasons[zero_slots.key]

    for key in (zero_dim.key, zero_slots.key):
        assert key not in m
        assert key in m.dropped_keys
        assert key not in m.keys
        with raises_naming(key_label(key)):
            m.index(key)
    assert m.keys == (kept.key,)
    for view in (m.addrs, m.nbytes, m.slot_nbytes, m.tp_dims, m.slots):
        assert view.shape == (1,)
    assert m.addrs.tolist() == [0x1000]
    assert m.pools == {"kv": 4}  # the state pool had only the dropped region


def test_empty_region_given_straight_to_manifest_is_an_error() -> None:
    empty = region("temporal", pool="state", slot_shape=(0, 0, 0))
    with raises_naming("state/temporal[0]", "Manifest.build"):
        Manifest((region(), empty), 0, 1)


# -- every other invalid region is a ManifestError naming it -----------------


def test_duplicate_key() -> None:
    a = region("k", 3, part=1, addr=0x1000)
    b = region("k", 3, part=1, addr=0x9000)
    with raises_naming(LABEL, "twice") as info:
        Manifest.build([a, b])
    assert info.value.subject == KEY


def test_nbytes_not_a_multiple_of_the_slot_size() -> None:
    bad = Region(
        pool="kv", name="k", layer=3, part=1, addr=0x1000, nbytes=70, slot_shape=(2, 8), itemsize=2
    )
    with raises_naming(LABEL, "70", "32"):
        Manifest.build([bad])


def test_null_address() -> None:
    with raises_naming(LABEL, "null"):
        Manifest.build([region("k", 3, part=1, addr=0)])


def test_partial_overlap_names_both_regions() -> None:
    a = region("k", 0, addr=0x1000)  # 128 bytes
    b = region("v", 0, addr=0x1000 + 127)
    with raises_naming("kv/k[0]", "kv/v[0]", "overlap"):
        Manifest.build([b, a])


def test_region_containing_two_others_is_an_overlap() -> None:
    big = region("big", 0, pool="aux", addr=0x1000, slots=64)  # [0x1000, 0x3000)
    inner1 = region("a", 0, addr=0x1100)
    inner2 = region("b", 0, addr=0x2000)
    with raises_naming("aux/big[0]", "overlap"):
        Manifest.build([inner1, inner2, big])


def test_adjacent_regions_do_not_overlap() -> None:
    a = region("k", 0, addr=0x1000)
    b = region("v", 0, addr=0x1000 + 128)  # starts where a ends
    assert len(Manifest.build([a, b])) == 2


def test_same_address_on_another_device_is_an_overlap() -> None:
    """A descriptor carries an address, not a device: two regions there would be ambiguous."""
    a = region("k", 0, addr=0x1000)
    c = region("k", 1, addr=0x1000, device="cuda:0")
    with raises_naming("kv/k[0]", "kv/k[1]", "overlap"):
        Manifest.build([a, c])


def test_tp_axis_out_of_range() -> None:
    with raises_naming(LABEL, "tp_axis 2"):
        Manifest.build([region("k", 3, part=1, tp_axis=2)], tp_size=2)


def test_groups_not_divisible_by_tp_size() -> None:
    r = region("k", 3, part=1, slot_shape=(3, 4), tp_axis=0, tp_groups=(3, 3))
    with raises_naming(LABEL, "not divisible"):
        Manifest.build([r], tp_rank=0, tp_size=2)


def test_groups_disagreeing_with_local_size() -> None:
    r = region("k", 3, part=1, slot_shape=(3, 4), tp_axis=0, tp_groups=(4, 4))
    with raises_naming(LABEL, "(4, 4)"):
        Manifest.build([r], tp_rank=0, tp_size=2)


def test_groups_on_a_replicated_region() -> None:
    with raises_naming(LABEL, "replicated"):
        Manifest.build([region("k", 3, part=1, tp_groups=(2,))])


@pytest.mark.parametrize(
    ("local", "tp_size", "tp_global", "groups"),
    [
        (2, 2, 5, None),  # [4, 5) held by no rank
        (4, 2, 3, None),  # a share larger than the axis
        (4, 2, 9, (4, 4)),  # tp_global and groups disagree
    ],
)
def test_tp_global_inconsistent(local, tp_size, tp_global, groups) -> None:
    r = region(
        "k", 3, part=1, slot_shape=(local, 8), tp_axis=0, tp_global=tp_global, tp_groups=groups
    )
    with raises_naming(LABEL, str(tp_global)):
        Manifest.build([r], tp_rank=0, tp_size=tp_size)


def test_tp_global_smaller_than_local_times_tp_is_valid_replication() -> None:
    """GQA with more ranks than KV heads: 2 heads over 4 ranks, one head each, held twice."""
    r = region("k", 3, part=1, slot_shape=(1, 8), tp_axis=0, tp_global=2)
    m = Manifest.build([r], tp_rank=3, tp_size=4)
    assert m.tp_dims.tolist() == [1]


@pytest.mark.parametrize(("tp_rank", "tp_size"), [(2, 2), (-1, 2), (0, 0)])
def test_bad_tp_rank(tp_rank: int, tp_size: int) -> None:
    with pytest.raises(ManifestError, match=rf"tp_rank {tp_rank}.*tp_size {tp_size}"):
        Manifest.build([region()], tp_rank=tp_rank, tp_size=tp_size)


def test_pool_regions_disagree_on_slot_count() -> None:
    a = region("k", 0, addr=0x1000, slots=4)
    b = region("v", 0, addr=0x9000, slots=5)
    with raises_naming("kv/v[0]", "kv/k[0]", "5", "4"):
        Manifest.build([a, b])
    # Different pools may have different slot counts.
    c = region("conv", 0, pool="state", addr=0x9000, slots=5)
    assert Manifest.build([a, c]).pools == {"kv": 4, "state": 5}


def test_bad_device_and_itemsize() -> None:
    with raises_naming(LABEL, "gpu0"):
        Manifest.build([region("k", 3, part=1, device="gpu0")])
    bad = Region(
        pool="kv", name="k", layer=3, part=1, addr=0x1000, nbytes=8, slot_shape=(2,), itemsize=0
    )
    with raises_naming(LABEL, "itemsize"):
        Manifest.build([bad])


def test_region_both_kept_and_dropped() -> None:
    from xferkit import Dropped

    with raises_naming(LABEL, "dropped"):
        Manifest((region("k", 3, part=1),), 0, 1, (Dropped(KEY, "0 bytes"),))


# -- derived views ----------------------------------------------------------


def _empty(r: Region) -> bool:
    return r.nbytes == 0


@settings(max_examples=100, deadline=None)
@given(drawn=manifest_regions())
def test_views_are_aligned_and_empties_never_reach_them(drawn: Regions) -> None:
    m = Manifest.build(drawn.regions, tp_rank=drawn.tp_rank, tp_size=drawn.tp_size)
    kept = [r for r in drawn.regions if not _empty(r)]
    gone = [r for r in drawn.regions if _empty(r)]
    assert list(m.regions) == kept  # input order, empties removed
    assert [d.key for d in m.dropped] == [r.key for r in gone]
    assert all(d.reason for d in m.dropped)
    assert len(m) == len(kept)
    for view in (m.addrs, m.nbytes, m.slot_nbytes, m.tp_dims, m.slots):
        assert view.dtype == np.uint64 and view.shape == (len(kept),)
        assert not view.flags.writeable
    for i, r in enumerate(kept):
        assert m.keys[i] == (r.pool, r.name, r.layer, r.part)
        assert int(m.addrs[i]) == r.addr
        assert int(m.nbytes[i]) == r.nbytes
        assert int(m.slot_nbytes[i]) == math.prod(r.slot_shape) * r.itemsize
        assert int(m.slots[i]) * int(m.slot_nbytes[i]) == r.nbytes
        assert int(m.tp_dims[i]) == (0 if r.tp_axis is None else r.slot_shape[r.tp_axis])
        assert m.index(r.key) == i
        assert m.region(r.key) is m.regions[i]
    for r in gone:
        assert r.key not in m and r.key not in m.keys
    # Round trip through msgspec: equal manifest, equal views.
    back = Manifest.decode(m.encode())
    assert back == m
    assert back.keys == m.keys
    assert back.dropped == m.dropped
    for name in ("addrs", "nbytes", "slot_nbytes", "tp_dims", "slots"):
        assert np.array_equal(getattr(back, name), getattr(m, name))


def test_views_are_read_only() -> None:
    m = Manifest.build([region("k", addr=0x1000), region("v", addr=0x2000)])
    for view in (m.addrs, m.nbytes, m.slot_nbytes, m.tp_dims, m.slots):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    assert isinstance(m.keys, tuple)
    with pytest.raises(AttributeError):
        m.regions = ()  # type: ignore[misc]


# -- msgspec round trip -----------------------------------------------------


def test_round_trip_keeps_sharding_fields_and_dropped() -> None:
    regions = [
        region("k", 0, addr=0x1000, slot_shape=(4, 1, 8), tp_axis=1, tp_global=2),
        region(
            "conv",
            0,
            pool="state",
            addr=0x100000,
            slots=2,
            slot_shape=(8, 3),
            tp_axis=0,
            tp_groups=(8, 8, 16),
            device="cuda:1",
        ),
        region("temporal", 0, pool="state", slot_shape=(0, 0, 0), addr=0),
    ]
    m = Manifest.build(regions, tp_rank=3, tp_size=4)
    back = Manifest.decode(m.encode())
    assert back == m
    assert back.regions[1].tp_groups == (8, 8, 16)
    assert back.regions[0].tp_global == 2
    assert back.tp_rank == 3 and back.tp_size == 4
    assert back.dropped_keys == {("state", "temporal", 0, 0)}


def _valid_bytes() -> bytes:
    return Manifest.build([region("k", addr=0x1000)]).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a msgpack opcode that is never used
        b"not msgpack at all",
        _valid_bytes()[:-3],  # truncated
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"regions": "nope", "tp_rank": 0, "tp_size": 1}),
        msgspec.msgpack.encode({"regions": [], "tp_rank": "0", "tp_size": 1}),
    ],
    ids=["empty", "bad-opcode", "text", "truncated", "array", "bad-field", "bad-type"],
)
def test_decode_garbage_is_a_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(data)


def test_decode_validates_like_build() -> None:
    raw = msgspec.to_builtins(Manifest.build([region("k", 3, part=1, addr=0x1000)]))
    raw["regions"] = [raw["regions"][0], raw["regions"][0]]
    with raises_naming(LABEL, "twice"):
        Manifest.decode(msgspec.msgpack.encode(raw))
    raw = msgspec.to_builtins(Manifest.build([region("k", 3, part=1, addr=0x1000)]))
    raw["regions"][0]["nbytes"] = 0
    with raises_naming(LABEL, "Manifest.build"):
        Manifest.decode(msgspec.msgpack.encode(raw))
