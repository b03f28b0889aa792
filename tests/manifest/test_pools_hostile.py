"""The pool builders and ``Region.from_array`` as a careless engine calls them: arguments of
any type, the same memory described twice, torch tensors whose memory is swapped or whose
bytes are not their values.

Whatever a builder accepts must survive what a Session does with it next: a manifest that
builds must encode and decode, since a peer's handshake carries it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit import pools

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=8),
    st.lists(st.integers(-(2**70), 2**70), max_size=3),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
    st.builds(lambda n: np.arange(n), st.integers(0, 4)),
    st.builds(object),
    st.sampled_from([pools.Shard(0), pools.Shard(1, groups=(2, 2)), "NHD", "HND", "cuda:0"]),
)


def _kv() -> np.ndarray:
    return np.zeros((4, 2, 2, 8), np.float32)  # [slots, token, head, dim]


def _state() -> np.ndarray:
    return np.zeros((2, 4, 2, 6), np.float32)  # [layers, slots, head, dim]


BUILDERS: dict[str, Callable[[dict[str, Any]], list[xk.Region]]] = {
    "kv_pages": lambda kw: pools.kv_pages(
        **{"pool": "kv", "k": [_kv()], "v": [_kv()], "layout": "NHD", **kw}
    ),
    "mla_pages": lambda kw: pools.mla_pages(**{"pool": "mla", "latent": [_kv()], **kw}),
    "state_pool": lambda kw: pools.state_pool(
        **{"pool": "s", "fields": {"x": _state()}, "shards": {"x": pools.Shard(0)}, **kw}
    ),
    "aux_rows": lambda kw: pools.aux_rows(**{"pool": "aux", "fields": {"x": _kv()}, **kw}),
}
ARGS = {
    "kv_pages": ["pool", "k", "v", "layout", "layers", "shard_heads", "heads_global", "device"],
    "mla_pages": ["pool", "latent", "layers", "name", "axes", "device"],
    "state_pool": ["pool", "fields", "shards", "exclude", "layers", "device"],
    "aux_rows": ["pool", "fields", "exclude", "device"],
}
CALLS = [(b, a) for b, args in ARGS.items() for a in args]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=st.sampled_from(CALLS), value=anything, tp=st.sampled_from([1, 2]))
def test_a_builder_with_any_argument_gives_regions_a_peer_can_decode_or_an_xfer_error(
    call: tuple[str, str], value: Any, tp: int
) -> None:
    """Each builder with one argument drawn from anything: an XferError, or regions whose
    manifest builds, encodes and decodes to itself (what a handshake does with it)."""
    builder, arg = call
    with contextlib.suppress(xk.XferError):
        manifest = xk.Manifest.build(BUILDERS[builder]({arg: value}), tp_size=tp)
        assert xk.Manifest.decode(manifest.encode()) == manifest


@pytest.mark.parametrize("field", ["layer", "part"])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70])
def test_a_region_key_past_64_bits_is_refused_where_it_is_made(field: str, value: int) -> None:
    """Defect: ``layers=[2**70]`` (or such a ``part``) made a Region and a Manifest, and a
    Session over it started, but its handshake raised OverflowError in the control thread
    (msgpack holds 64-bit ints) and every request failed 10 s later with "no handshake reply",
    a misleading cause. Fixed: a Region's layer and part are 64-bit ints, checked when the
    Region is made, naming the field."""
    with pytest.raises(xk.ManifestError, match=f"{field} must be a 64-bit int"):
        xk.Region.from_array(_kv(), pool="kv", name="k", **{"layer": 0, field: value})  # type: ignore[arg-type]
    if field == "layer":  # a negative id is the builder's own refusal
        with pytest.raises(xk.XferError, match="layer"):
            pools.kv_pages("kv", k=[_kv()], v=[_kv()], layout="NHD", layers=[value])
    keys: dict[str, Any] = {"layer": 0, field: 2**63 - 1}
    ok = xk.Region.from_array(_kv(), pool="kv", name="k", **keys)
    manifest = xk.Manifest.build([ok])
    assert xk.Manifest.decode(manifest.encode()) == manifest


# -- the same memory twice ---------------------------------------------------------------------


def test_two_pools_over_the_same_memory_are_refused_naming_both() -> None:
    """A KV pool and an aux pool over one buffer, overlapping views of one tensor, one tensor
    as two parts of a field: each would let one pool's write land in the other's memory."""
    buf = np.zeros((4, 2, 2, 8), np.float32)
    other = np.zeros_like(buf)
    cases = [
        pools.kv_pages("kv", k=[buf], v=[other], layout="NHD")
        + pools.aux_rows("aux", fields={"x": buf.reshape(4, -1)}),
        pools.aux_rows("aux", fields={"a": buf[:2], "b": buf[1:3]}),
        pools.aux_rows("aux", fields={"a": [buf, buf]}),
        pools.mla_pages("mla", latent=[buf[:3], buf[1:]]),
    ]
    for regions in cases:
        with pytest.raises(xk.ManifestError, match="overlap"):
            xk.Manifest.build(regions)
    t = torch.zeros(8, 16)
    with pytest.raises(xk.ManifestError, match="overlap"):
        xk.Manifest.build(pools.aux_rows("aux", fields={"a": t[0:4], "b": t[3:7]}))


# -- torch tensors whose memory or meaning changes ---------------------------------------------


def _mapped(lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` lies inside one mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if a <= lo and hi <= b:
                return True
    return False


@pytest.mark.parametrize("swap", ["set_", "data", "del"])
def test_a_registered_tensors_memory_stays_mapped_whatever_the_engine_does_to_it(
    swap: str,
) -> None:
    """Defect: a Region kept the tensor object alive but not its memory: ``t.set_()`` or
    ``t.data = ...`` (as engines do to release or swap a buffer) freed the storage, and the
    64 MiB range the Region (and any backend it is registered with) still named was
    unmapped: the next write into it would fault or land in reused memory. Fixed: the
    Region holds the tensor's storage too, so its range stays mapped as long as the Region.
    Deleting the caller's names (``del``) never freed it."""
    t = torch.zeros((1 << 10, 16 << 10), dtype=torch.float32)  # 64 MiB: its own mapping
    region = pools.aux_rows("aux", fields={"x": t})[0]
    assert _mapped(region.addr, region.addr + region.nbytes)
    if swap == "set_":
        t.set_()  # type: ignore[call-overload]  # no source: an empty storage
    elif swap == "data":
        t.data = torch.zeros(0)
    del t
    gc.collect()
    assert _mapped(region.addr, region.addr + region.nbytes), "the registered range was freed"
    manifest = xk.Manifest.build([region])
    with xk.open_backend("loopback") as b:
        b.register(manifest)  # still registrable: the memory is still there


@pytest.mark.parametrize(
    "view",
    [
        lambda: torch.zeros(4, 3, dtype=torch.complex64).conj(),
        lambda: torch._neg_view(torch.zeros(4, 3)),
    ],
    ids=["conj", "neg"],
)
def test_a_lazy_conj_or_neg_view_is_refused_since_its_bytes_are_not_its_values(
    view: Callable[[], torch.Tensor],
) -> None:
    """Defect: ``t.conj()`` of a complex tensor (and a negative view) is contiguous and at
    ``t``'s address, so it registered as that memory, but its values are the conjugates of
    the bytes: a transfer moves the bytes, and the peer's tensor shows other values than
    this one did. Fixed: refused, saying to register the tensor it is a view of."""
    with pytest.raises(xk.ManifestError, match=r"lazy .* view"):
        xk.Region.from_array(view(), pool="p", name="x", layer=0)
    with pytest.raises(xk.ManifestError, match="lazy"):
        pools.aux_rows("aux", fields={"x": view()})
    plain = torch.zeros(4, 3, dtype=torch.complex64)
    assert xk.Region.from_array(plain, pool="p", name="x", layer=0).addr == plain.data_ptr()
