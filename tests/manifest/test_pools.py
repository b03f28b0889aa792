"""``xferkit.pools``: each builder against regions built by hand, a TP 2 -> 4 handoff of a
hybrid described with them through loopback backends (byte-exact against the reference
model), a property over random state pools, and wrong arguments of every kind."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit import Manifest, Region, pools
from xferkit.pools import Shard
from xferkit.testing import Reference, RegionSpec, close_all, handoff

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def by_hand(
    array: np.ndarray, pool: str, name: str, layer: int, part: int = 0, **tp: Any
) -> Region:
    """A region written out field by field, from numpy's own view of ``array``."""
    return Region(
        pool=pool,
        name=name,
        layer=layer,
        part=part,
        addr=array.ctypes.data,
        nbytes=array.nbytes,
        slot_shape=tuple(array.shape[1:]),
        itemsize=array.itemsize,
        **tp,
    )


# -- each builder against hand-built regions ----------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_pages_name_and_shard_k_and_v_per_layer(layout: Literal["NHD", "HND"]) -> None:
    page = (4, 2, 8) if layout == "NHD" else (2, 4, 8)
    k = [np.zeros((5, *page), np.float16) for _ in range(3)]
    v = [np.ones((5, *page), np.float16) for _ in range(3)]
    got = pools.kv_pages("kv", k=k, v=v, layout=layout, layers=[1, 3, 5], heads_global=2)
    axes = ("token", "head", "dim") if layout == "NHD" else ("head", "token", "dim")
    head = axes.index("head")
    want = [
        by_hand(t, "kv", n, layer, tp_axis=head, tp_global=2, axes=axes)
        for n, ts in (("k", k), ("v", v))
        for layer, t in zip([1, 3, 5], ts, strict=True)
    ]
    assert got == want
    assert [r.owner is t for r, t in zip(got, k + v, strict=True)] == [True] * 6
    # Replicated heads (attention outside TP): no sharded axis at all.
    flat = pools.kv_pages("kv", k=k[:1], v=v[:1], layout=layout, shard_heads=False)
    assert [(r.key, r.tp_axis, r.tp_global) for r in flat] == [
        (("kv", "k", 0, 0), None, None),
        (("kv", "v", 0, 0), None, None),
    ]


def test_mla_pages_are_replicated_latents() -> None:
    latent = [np.zeros((6, 4, 1, 24), np.uint16) for _ in range(2)]
    got = pools.mla_pages("mla", latent=latent, layers=[0, 7], axes=("token", "one", "dim"))
    want = [
        by_hand(t, "mla", "latent", layer, axes=("token", "one", "dim"))
        for layer, t in zip([0, 7], latent, strict=True)
    ]
    assert got == want and all(r.tp_axis is None for r in got)
    m = Manifest.build(got, tp_rank=3, tp_size=4)  # replicated: any TP size holds all of it
    assert len(m) == 2 and not m.dropped


def test_state_pool_walks_streams_skips_none_and_excluded_and_leaves_empties_to_build() -> None:
    layers, slots = [0, 2, 4], 3
    conv = [np.zeros((3, slots, 3, 24), np.float16), np.zeros((3, slots, 3, 8), np.float16)]
    temporal = np.zeros((3, slots, 2, 8, 8), np.float32)
    sconv = np.zeros((3, slots, 0, 0, 0), np.float32)  # short conv: a degenerate temporal
    scratch = np.zeros((3, slots, 64), np.float32)
    got = pools.state_pool(
        "state",
        fields={
            "conv": conv,
            "temporal": temporal,
            "sconv": sconv,
            "intermediate": scratch,
            "ssm_extra": None,
        },
        shards={
            "conv": [Shard(1, groups=(16, 16, 16)), Shard(1)],
            "temporal": Shard(0),
            "sconv": None,
        },
        exclude=["intermediate"],
        layers=layers,
    )
    at = list(enumerate(layers))
    want = [
        *(by_hand(conv[0][i], "state", "conv", n, 0, tp_axis=1, tp_groups=GROUPS) for i, n in at),
        *(by_hand(conv[1][i], "state", "conv", n, 1, tp_axis=1) for i, n in at),
        *(by_hand(temporal[i], "state", "temporal", n, tp_axis=0) for i, n in at),
        *(by_hand(sconv[i], "state", "sconv", n) for i, n in at),
    ]  # fmt: skip
    assert got == want
    m = Manifest.build(got, tp_rank=0, tp_size=2)
    assert m.dropped_keys == {("state", "sconv", layer, 0) for layer in layers}
    assert all("zero-size axis" in d.reason for d in m.dropped)
    assert len(m) == 9 and m.pools == {"state": slots}
    # The scratch buffer's memory takes part in nothing.
    assert (m.locate(np.array([scratch.ctypes.data], np.uint64)) == -1).all()


def test_aux_rows_are_one_replicated_region_per_field_and_part() -> None:
    token = np.zeros((8, 1), np.int32)
    # logprob values and their token indices
    logprob: list[np.ndarray] = [np.zeros((8, 4), np.float32), np.zeros((8, 4), np.int64)]
    meta = np.zeros((8, 16), np.uint8)
    got = pools.aux_rows(
        "aux",
        fields={"token": token, "logprob": logprob, "meta": meta, "hidden": None},
        exclude=("meta",),
    )
    assert got == [
        by_hand(token, "aux", "token", 0),
        by_hand(logprob[0], "aux", "logprob", 0, 0),
        by_hand(logprob[1], "aux", "logprob", 0, 1),
    ]


class IndexableFakeTensor:
    """The torch.Tensor surface the builders use (shape, indexing, data_ptr...), over numpy:
    what a torch tensor offers, without importing torch."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.shape = array.shape
        self.device = "cpu"

    def __getitem__(self, i: int) -> IndexableFakeTensor:
        return IndexableFakeTensor(self._array[i])

    def data_ptr(self) -> int:
        return self._array.ctypes.data if self._array.size else 0

    def element_size(self) -> int:
        return self._array.itemsize

    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)


def test_tensors_are_duck_typed() -> None:
    temporal = np.zeros((2, 4, 2, 8), np.float32)
    empty = np.zeros((2, 4, 0), np.float32)  # torch reports data_ptr 0 for it
    got = pools.state_pool(
        "state",
        fields={"temporal": IndexableFakeTensor(temporal), "empty": IndexableFakeTensor(empty)},
        shards={"temporal": Shard(0), "empty": None},
    )
    assert got[:2] == [by_hand(temporal[i], "state", "temporal", i, tp_axis=0) for i in (0, 1)]
    assert [r.addr for r in got[2:]] == [0, 0]
    assert Manifest.build(got).dropped_keys == {("state", "empty", 0, 0), ("state", "empty", 1, 0)}


# -- a hybrid described with pools, TP 2 -> 4 through loopback -------------------

PAGE, KV_HEADS, HEAD_DIM = 4, 2, 8  # 2 KV heads: at TP 4 each head lives on two ranks
ATTENTION, RECURRENT = [1, 3], [0, 2]
GROUPS = (16, 16, 16)
SRC_SLOTS = {"kv": 6, "mla": 6, "state": 3, "aux": 4}
DST_SLOTS = {"kv": 9, "mla": 9, "state": 5, "aux": 6}
REQUEST = {
    "kv": (np.array([4, 0, 1]), np.array([2, 8, 3])),
    "mla": (np.array([5, 2]), np.array([0, 7])),
    "state": (np.array([1]), np.array([4])),
    "aux": (np.array([3]), np.array([0])),
}


def hybrid_specs() -> list[RegionSpec]:
    """What the model holds: the reference model's own description of it, independent of
    ``pools`` (source pages NHD, destination pages HND)."""
    kv_axes = ("token", "head", "dim")
    specs = [
        RegionSpec(
            pool="kv", name=n, layer=layer, shape=(PAGE, KV_HEADS, HEAD_DIM), tp_axis=1,
            axes=kv_axes, dst_order=(1, 0, 2),
        )
        for n in ("k", "v")
        for layer in ATTENTION
    ]  # fmt: skip
    specs += [
        RegionSpec(pool="mla", name="latent", layer=layer, shape=(PAGE, 12)) for layer in ATTENTION
    ]
    for part, shape, groups in ((0, (3, sum(GROUPS)), GROUPS), (1, (3, 8), None)):
        specs += [
            RegionSpec(
                pool="state", name="conv", layer=layer, part=part, shape=shape, tp_axis=1,
                tp_groups=groups,
            )
            for layer in RECURRENT
        ]  # fmt: skip
    specs += [
        RegionSpec(pool="state", name="temporal", layer=n, shape=(4, 8, 8), itemsize=4, tp_axis=0)
        for n in RECURRENT
    ]
    specs += [
        RegionSpec(pool="aux", name="token", layer=0, shape=(1,), itemsize=4),
        RegionSpec(pool="aux", name="logprob", layer=0, shape=(4,), itemsize=4),
    ]
    return specs


def typed(raw: np.ndarray) -> np.ndarray:
    """The reference's ``[..., itemsize]`` bytes as a typed array over the same memory."""
    dtype = {1: np.uint8, 2: np.float16, 4: np.float32, 8: np.float64}[raw.shape[-1]]
    out = raw.view(dtype)[..., 0]
    assert np.shares_memory(out, raw)
    return out


def describe_with_pools(rank: Any, side: str) -> list[Region]:
    """The rank as an engine would describe it: per-layer K/V and latents over the reference's
    own buffers; state stacked ``[layers, slots, ...]`` (so the reference's buffers become
    views of the stack); aux rows; plus what the engine has but does not move."""
    a = rank.arrays

    def stack(name: str, part: int = 0) -> np.ndarray:
        stacked = np.stack([a["state", name, layer, part] for layer in RECURRENT])
        for i, layer in enumerate(RECURRENT):
            a["state", name, layer, part] = stacked[i]  # the reference now checks the stack
        return typed(stacked)

    layout: Literal["NHD", "HND"] = "NHD" if side == "src" else "HND"
    k = [typed(a["kv", "k", layer, 0]) for layer in ATTENTION]
    v = [typed(a["kv", "v", layer, 0]) for layer in ATTENTION]
    kv = pools.kv_pages("kv", k=k, v=v, layout=layout, layers=ATTENTION, heads_global=KV_HEADS)
    latent = [typed(a["mla", "latent", layer, 0]) for layer in ATTENTION]
    mla = pools.mla_pages("mla", latent=latent, layers=ATTENTION)
    slots = len(a["state", "temporal", 0, 0])
    state = pools.state_pool(
        "state",
        fields={
            "conv": [stack("conv", 0), stack("conv", 1)],
            "temporal": stack("temporal"),
            "sconv": np.zeros((len(RECURRENT), slots, 0, 0, 0), np.float32),
            "intermediate": np.zeros((len(RECURRENT), slots, 32), np.float32),
            "extra": None,
        },
        shards={"conv": [Shard(1, groups=GROUPS), Shard(1)], "temporal": Shard(0), "sconv": None},
        exclude=["intermediate"],
        layers=RECURRENT,
    )
    token, logprob = typed(a["aux", "token", 0, 0]), typed(a["aux", "logprob", 0, 0])
    aux = pools.aux_rows("aux", fields={"token": token, "logprob": logprob})
    return kv + mla + state + aux


def test_a_hybrid_described_with_pools_hands_off_tp2_to_tp4_byte_exact() -> None:
    ref = Reference(
        hybrid_specs(), src_tp=2, dst_tp=4, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS, seed=3
    )
    for side, ranks in (("src", ref.srcs), ("dst", ref.dsts)):
        for rank in ranks:
            own = {r.key: r for r in rank.manifest}
            regions = describe_with_pools(rank, side)
            m = Manifest.build(regions, tp_rank=rank.tp_rank, tp_size=rank.tp_size)
            # Same keys and geometry as the reference's own regions; the degenerate field
            # dropped; per-layer pools at the very same addresses.
            assert set(m.keys) == set(own)
            assert m.dropped_keys == {("state", "sconv", layer, 0) for layer in RECURRENT}
            for r in m:
                o = own[r.key]
                # (tp_global may be spelled out where it is local * tp: same layout.)
                assert (r.slot_shape, r.nbytes, r.tp_axis, r.tp_groups, r.axes) == (
                    o.slot_shape, o.nbytes, o.tp_axis, o.tp_groups, o.axes,
                )  # fmt: skip
                assert r.axis_layout(rank.tp_size) == o.axis_layout(rank.tp_size)
                assert r.addr == rank.arrays[r.key].ctypes.data
                if r.pool != "state":
                    assert r.addr == o.addr
            rank.manifest = m
    opened: list[xk.Backend] = []
    try:
        for rank in ref.srcs + ref.dsts:
            backend = xk.open_backend("loopback")
            opened.append(backend)
            backend.register(rank.manifest)
        srcs, dsts = opened[: len(ref.srcs)], opened[len(ref.srcs) :]

        def write(s: int, d: int, descs: xk.Descriptors) -> None:
            peer = srcs[s].connect(dsts[d].endpoint(), ref.dsts[d].manifest)
            srcs[s].write(peer, descs).wait(10)

        counts = handoff(ref, REQUEST, write=write)
    finally:
        close_all(*opened)
    # handoff compared every destination byte with the reference; each decode rank's sharded
    # part comes from one source (ranks 0, 1 from source 0), replicated rows from either.
    assert sorted(counts) == [0, 1, 2, 3]
    assert 0 in counts[0] and 0 in counts[1] and 1 in counts[2] and 1 in counts[3]


# -- a property over random state pools --------------------------------------------

field_shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@SETTINGS
@given(
    layers=st.integers(0, 4),
    slots=st.integers(0, 3),
    fields=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.one_of(
            st.none(),
            field_shapes,
            st.lists(field_shapes, min_size=1, max_size=3),
        ),
        max_size=5,
    ),
    excluded=st.sets(st.sampled_from(["a", "b", "c", "d", "e"])),
)
def test_state_pool_regions_and_dropped_list(
    layers: int, slots: int, fields: dict[str, Any], excluded: set[str]
) -> None:
    excluded &= set(fields)

    def tensor(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros((layers, slots, *shape), np.float32)

    tensors = {
        f: None
        if spec is None
        else [tensor(s) for s in spec]
        if isinstance(spec, list)
        else tensor(spec)
        for f, spec in fields.items()
    }
    got = pools.state_pool(
        "s", fields=tensors, shards=dict.fromkeys(tensors), exclude=sorted(excluded)
    )
    want: dict[tuple[str, str, int, int], np.ndarray] = {}
    for f, t in tensors.items():
        if t is None or f in excluded:
            continue
        for part, entry in enumerate(t if isinstance(t, list) else [t]):
            for layer in range(layers):
                want["s", f, layer, part] = entry[layer]
    assert [r.key for r in got] == list(want)
    m = Manifest.build(got)
    empty = {k for k, a in want.items() if a.size == 0}
    assert m.dropped_keys == empty and len(m.dropped) == len(empty)
    assert set(m.keys) == set(want) - empty
    for r in m:
        assert r.addr == want[r.key].ctypes.data and r.nbytes == want[r.key].nbytes


# -- wrong arguments -------------------------------------------------------------

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
    st.builds(lambda n: np.arange(n), st.integers(0, 4)),
    st.builds(lambda: np.zeros((2, 3, 4), np.float32)),
    st.builds(lambda: [np.zeros((2, 3, 4), np.float32), "x"]),
    st.builds(object),
    st.sampled_from([Shard(0), Shard(5), [Shard(0)], ("NHD",), "NHD", "HND", range(2)]),
)


def only_xfer_errors(call: Callable[[], Any]) -> None:
    with contextlib.suppress(xk.XferError):
        Manifest.build(call(), tp_size=1)


GOOD_KV = np.zeros((3, 4, 2, 8), np.float16)
GOOD_STATE = np.zeros((2, 3, 4), np.float32)


@SETTINGS
@given(
    arg=st.sampled_from(["pool", "k", "v", "layout", "layers", "shard_heads", "heads_global"]),
    value=anything,
)
def test_kv_pages_wrong_arguments(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"k": [GOOD_KV], "v": [GOOD_KV.copy()], "layout": "NHD"}
    kwargs[arg] = value
    pool = kwargs.pop("pool", "kv")
    only_xfer_errors(lambda: pools.kv_pages(pool, **kwargs))


@SETTINGS
@given(arg=st.sampled_from(["pool", "latent", "layers", "name", "axes", "device"]), value=anything)
def test_mla_pages_wrong_arguments(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"latent": [GOOD_KV[:, :, 0]], arg: value}
    pool = kwargs.pop("pool", "mla")
    only_xfer_errors(lambda: pools.mla_pages(pool, **kwargs))


@SETTINGS
@given(
    arg=st.sampled_from(["pool", "fields", "shards", "exclude", "layers", "device"]),
    value=anything,
    field_value=anything,
    shard=anything,
)
def test_state_pool_and_aux_rows_wrong_arguments(
    arg: str, value: Any, field_value: Any, shard: Any
) -> None:
    kwargs: dict[str, Any] = {"fields": {"x": GOOD_STATE}, "shards": {"x": Shard(1)}, arg: value}
    pool = kwargs.pop("pool", "state")
    only_xfer_errors(lambda: pools.state_pool(pool, **kwargs))
    only_xfer_errors(
        lambda: pools.state_pool("state", fields={"x": field_value}, shards={"x": shard})
    )
    kwargs.pop("shards", None)
    kwargs.pop("layers", None)
    only_xfer_errors(lambda: pools.aux_rows(pool, **kwargs))
    only_xfer_errors(lambda: pools.aux_rows("aux", fields={"x": field_value}))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: pools.state_pool(
                "s", fields={"conv": [GOOD_STATE, GOOD_STATE, "x"]}, shards={"conv": None}
            ),
            "pools.state_pool: field 'conv' entry 2: ",
        ),
        (
            lambda: pools.state_pool("s", fields={"conv": GOOD_STATE}, shards={}),
            "pools.state_pool: field 'conv': no sharding declared",
        ),
        (
            lambda: pools.state_pool(
                "s", fields={"conv": GOOD_STATE}, shards={"conv": Shard(1)}, exclude=["cnov"]
            ),
            "exclude names ['cnov'], which are not fields",
        ),
        (
            lambda: pools.state_pool("s", fields={"conv": GOOD_STATE}, shards={"conv": Shard(3)}),
            "field 'conv': Shard axis 3 is out of range for slot shape (4,)",
        ),
        (
            lambda: pools.state_pool(
                "s",
                fields={"a": GOOD_STATE, "b": np.zeros((3, 3, 4))},
                shards={"a": None, "b": None},
            ),
            "field 'b': 3 layers on axis 0, but the pool has 2",
        ),
        (
            lambda: pools.state_pool(
                "s", fields={"a": [GOOD_STATE]}, shards={"a": [Shard(1), Shard(1)]}
            ),
            "shards['a']: 2 declarations for 1 entries",
        ),
        (
            lambda: pools.kv_pages("kv", k=[GOOD_KV], v=[], layout="NHD"),
            "k has 1 layers but v has 0",
        ),
        (
            lambda: pools.kv_pages("kv", k=[GOOD_KV], v=[GOOD_KV[0]], layout="NHD"),
            "pools.kv_pages: v[0]: shape (4, 2, 8) is not [slots, token, head, dim]",
        ),
        (
            lambda: pools.kv_pages("kv", k=[GOOD_KV], v=[GOOD_KV], layout="NHD", layers=[2, 2]),
            "pools.kv_pages: 2 layer ids for 1 layers of k and v",
        ),
        (
            lambda: pools.kv_pages("kv", k=[GOOD_KV[:, ::2]], v=[GOOD_KV], layout="NHD"),
            "pools.kv_pages: k[0]: region kv/k[0]: the array of shape (3, 2, 2, 8) is not "
            "C-contiguous",
        ),
        (
            lambda: pools.aux_rows("aux", fields={"token": GOOD_STATE[0], "meta": []}),
            "pools.aux_rows: field 'meta' is an empty list",
        ),
    ],
)
def test_wrong_arguments_name_the_field(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(xk.XferError, match=None) as info:
        call()
    assert message in str(info.value)


def test_kv_layer_ids_must_not_repeat() -> None:
    with pytest.raises(xk.ArgumentError, match=r"layer ids \[2, 2\] repeat"):
        pools.kv_pages("kv", k=[GOOD_KV] * 2, v=[GOOD_KV] * 2, layout="NHD", layers=[2, 2])


@SETTINGS
@given(axis=anything, groups=anything, global_size=anything)
def test_shard_wrong_arguments(axis: Any, groups: Any, global_size: Any) -> None:
    def build() -> list[Region]:
        shard = Shard(axis, groups=groups, global_size=global_size)
        return pools.state_pool("s", fields={"x": GOOD_STATE}, shards={"x": shard})

    only_xfer_errors(build)
