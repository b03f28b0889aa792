"""Real CPU torch tensors as regions: every dtype and view moved byte-exact, the rest refused.

Bytes are compared through ``.view(torch.uint8)``: the buffers hold random bytes, so bf16 and
fp8 NaN payloads too, which only a byte copy keeps.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.session import Session, State
from xferkit.testing.memory import random_bytes

WAIT_S = 10.0
SLOTS = 8
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` holding random bytes (NaN and inf patterns included)."""
    out = torch.empty(tuple(shape), dtype=dtype)
    raw = out.view(torch.uint8).view(-1)
    raw.copy_(torch.from_numpy(random_bytes(raw.numel(), seed)))
    return out


def raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` (contiguous), one uint8 row per slot."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def regions(tensors: dict[str, torch.Tensor], pool: str = "kv") -> list[xk.Region]:
    return [xk.Region.from_array(t, pool=pool, name=n, layer=0) for n, t in tensors.items()]


def raises_naming(label: str, *more: str) -> pytest.RaisesExc[xk.ManifestError]:
    pattern = "".join(f"(?=.*{re.escape(s)})" for s in (label, *more))
    return pytest.raises(xk.ManifestError, match=re.compile(pattern, re.S))


class Link:
    """Two real loopback backends, ``a`` connected to ``b``; ``move`` writes a request."""

    def __init__(self, src: xk.Manifest, dst: xk.Manifest) -> None:
        self.a, self.b = xk.open_backend("loopback"), xk.open_backend("loopback")
        self.a.register(src)
        self.b.register(dst)
        self.peer = self.a.connect(self.b.endpoint(), dst)
        self.plan = xk.plan(src, dst)

    def move(self, request: dict[str, tuple[list[int], list[int]]]) -> None:
        self.a.write(self.peer, self.plan.expand(request)).wait(WAIT_S)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def link(src: list[xk.Region], dst: list[xk.Region]) -> Link:
    return Link(xk.Manifest.build(src), xk.Manifest.build(dst))


# -- dtypes -----------------------------------------------------------------------------


SRC = {name_of(d): random_tensor((SLOTS, 4, 16), d, seed=i) for i, d in enumerate(DTYPES)}
DST = {name_of(d): torch.zeros((SLOTS, 4, 16), dtype=d) for d in DTYPES}


@pytest.fixture(scope="module")
def dtype_link() -> Iterator[Link]:
    pair = link(regions(SRC), regions(DST))
    yield pair
    pair.close()


def test_a_manifest_of_every_dtype_describes_each_tensor() -> None:
    m = xk.Manifest.build(regions(SRC))
    assert m.keys == tuple(("kv", n, 0, 0) for n in SRC)
    for r, t in zip(m.regions, SRC.values(), strict=True):
        assert (r.addr, r.itemsize, r.device) == (t.data_ptr(), t.element_size(), "cpu")
        assert r.nbytes == t.numel() * t.element_size() and r.slot_shape == (4, 16)
    assert list(m.slot_nbytes) == [64 * t.element_size() for t in SRC.values()]
    assert m.pools == {"kv": SLOTS} and m.dropped == ()


@settings(max_examples=25, deadline=None)
@given(
    src=st.permutations(range(SLOTS)),
    dst=st.permutations(range(SLOTS)),
    count=st.integers(1, SLOTS),
)
def test_every_dtype_moves_byte_exact_through_the_loopback(
    dtype_link: Link, src: list[int], dst: list[int], count: int
) -> None:
    src_slots, dst_slots = src[:count], dst[:count]
    for t in DST.values():
        t.view(torch.uint8).fill_(0xA5)
    dtype_link.move({"kv": (src_slots, dst_slots)})
    untouched = sorted(set(range(SLOTS)) - set(dst_slots))
    for name, tensor in DST.items():
        got, want = raw(tensor), raw(SRC[name])
        np.testing.assert_array_equal(got[dst_slots], want[src_slots], err_msg=name)
        assert (got[untouched] == 0xA5).all(), name


def test_every_dtype_moves_between_two_sessions() -> None:
    """The engine's path: expect / offer / write between two Sessions over the loopback."""
    dst = {n: torch.zeros_like(t) for n, t in SRC.items()}
    pre = Session(xk.open_backend("loopback"), xk.Manifest.build(regions(SRC)))
    dec = Session(xk.open_backend("loopback"), xk.Manifest.build(regions(dst)))
    try:
        recv = dec.expect("r", [pre.address], {"kv": [7, 0, 3]})
        send = pre.offer("r")
        send.write({"kv": [1]})
        send.write({"kv": [2, 5]}, last=True)
        assert recv.wait(WAIT_S) is State.DONE and send.wait(WAIT_S) is State.DONE
    finally:
        pre.close()
        dec.close()
    for name, t in dst.items():
        np.testing.assert_array_equal(raw(t)[[7, 0, 3]], raw(SRC[name])[[1, 2, 5]], name)
        assert not raw(t)[[1, 2, 4, 5, 6]].any(), name


# -- views ------------------------------------------------------------------------------


def test_slices_with_a_storage_offset_register_their_own_address_and_move_their_bytes() -> None:
    """K and V halves of one ``[2, pages, ...]`` buffer, and a page-axis slice of a pool."""
    src_kv = random_tensor((2, 16, 4, 8), torch.bfloat16, seed=1)
    dst_kv = torch.zeros((2, 12, 4, 8), dtype=torch.bfloat16)
    src_pool = random_tensor((16, 4, 8), torch.float8_e4m3fn, seed=2)
    dst_pool = torch.zeros((20, 4, 8), dtype=torch.float8_e4m3fn)
    src = regions({"k": src_kv[0], "v": src_kv[1]}) + regions({"p": src_pool[2:14]}, "pages")
    dst = regions({"k": dst_kv[0], "v": dst_kv[1]}) + regions({"p": dst_pool[4:16]}, "pages")
    # Each view registers at its own first byte, not at its storage's.
    assert dst[1].addr == dst_kv.data_ptr() + 12 * 4 * 8 * 2 == dst_kv[1].data_ptr()
    assert dst[2].addr == dst_pool.data_ptr() + 4 * 4 * 8
    assert src[2].addr == src_pool.data_ptr() + 2 * 4 * 8
    assert [r.slots for r in src] == [16, 16, 12] and [r.slots for r in dst] == [12, 12, 12]
    pair = link(src, dst)
    try:
        pair.move({"kv": ([15, 3], [11, 0]), "pages": ([11, 0], [0, 11])})
    finally:
        pair.close()
    got_kv, want_kv = raw(dst_kv.view(-1, 4, 8)), raw(src_kv.view(-1, 4, 8))  # rows: k, then v
    np.testing.assert_array_equal(got_kv[[11, 0, 23, 12]], want_kv[[15, 3, 31, 19]])
    assert not np.delete(got_kv, [11, 0, 23, 12], axis=0).any()
    got, want = raw(dst_pool), raw(src_pool)
    np.testing.assert_array_equal(got[[4, 15]], want[[13, 2]])  # view slots 0, 11 of each side
    assert not np.delete(got, [4, 15], axis=0).any()  # nothing before, after or between


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.transpose(0, 1),
        lambda t: t[:, ::2],
        lambda t: t[::2],
        lambda t: t[:, :, 0],
        lambda t: t[:1].expand(4, 6, 3),
    ],
    ids=["transposed", "inner-stride", "slot-stride", "column", "expanded"],
)
def test_non_contiguous_tensors_are_refused_saying_what_to_register(view) -> None:
    t = torch.zeros((4, 6, 3), dtype=torch.bfloat16)
    with raises_naming("kv/k[3]#1", "not C-contiguous", ".contiguous() would copy", "view of"):
        xk.Region.from_array(view(t), pool="kv", name="k", layer=3, part=1)


# -- what is dropped, what is refused, what is accepted ---------------------------------


def test_zero_size_tensors_are_dropped_by_the_empty_filter_not_registered() -> None:
    """A short conv's temporal state ``[layers, slots, 0, 0, 0]``: numel 0, data_ptr 0."""
    conv = random_tensor((2, SLOTS, 16), torch.bfloat16, seed=3)
    temporal = torch.zeros((2, SLOTS, 0, 0, 0), dtype=torch.bfloat16)
    assert temporal.numel() == 0
    built = [
        *[xk.Region.from_array(conv[i], pool="state", name="conv", layer=i) for i in range(2)],
        *[
            xk.Region.from_array(temporal[i], pool="state", name="temporal", layer=i)
            for i in range(2)
        ],
    ]
    m = xk.Manifest.build(built)
    assert m.keys == (("state", "conv", 0, 0), ("state", "conv", 1, 0))
    assert [d.key for d in m.dropped] == [("state", "temporal", i, 0) for i in range(2)]
    assert all("zero-size axis" in d.reason for d in m.dropped)
    with xk.open_backend("loopback") as b:
        b.register(m)  # the dropped regions' null address never reaches the driver
        assert b.manifest is m


@pytest.mark.parametrize("device", ["meta", "mps:0", "xpu:1", "cuda"])
def test_a_tensor_on_a_device_drivers_cannot_register_is_refused(device: str) -> None:
    class Tensor:  # torch's surface, on a device this machine may not have
        shape = (4, 8)

        def __init__(self) -> None:
            self.device = device

        def data_ptr(self) -> int:
            return 0x10000

        def element_size(self) -> int:
            return 2

        def is_contiguous(self) -> bool:
            return True

    with raises_naming("kv/k[0]", repr(device), "'cpu' nor 'cuda:N'"):
        xk.Region.from_array(Tensor(), pool="kv", name="k", layer=0)


def test_a_real_meta_tensor_is_refused() -> None:
    with raises_naming("kv/k[0]", "'meta'"):
        xk.Region.from_array(torch.empty((4, 8), device="meta"), pool="kv", name="k", layer=0)


def test_parameters_and_tensors_requiring_grad_are_memory_like_any_other() -> None:
    """Accepted: registration reads the address only; the bytes move, autograd is untouched."""
    weight = torch.nn.Parameter(random_tensor((SLOTS, 32), torch.float32, seed=4))
    leaf = torch.zeros((SLOTS, 32), requires_grad=True)
    pair = link(regions({"w": weight}, "w"), regions({"w": leaf}, "w"))
    try:
        assert pair.a.manifest is not None
        assert pair.a.manifest.regions[0].addr == weight.data_ptr()
        pair.move({"w": ([2, 6], [0, 1])})
    finally:
        pair.close()
    with torch.no_grad():
        np.testing.assert_array_equal(raw(leaf)[[0, 1]], raw(weight)[[2, 6]])
        assert not raw(leaf)[2:].any()
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad and leaf.requires_grad


def test_the_core_does_not_import_torch_unless_handed_a_tensor() -> None:
    script = (
        "import sys, numpy as np, xferkit as xk\n"
        "a = np.zeros((4, 8), np.float16)\n"
        "m = xk.Manifest.build([xk.Region.from_array(a, pool='p', name='a', layer=0)])\n"
        "with xk.open_backend('loopback') as b:\n"
        "    b.register(m)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


# -- pools over real tensors --------------------------------------------------------------


def test_pools_describe_real_tensors_as_engines_allocate_them() -> None:
    """vLLM's ``[2, blocks, block, heads, dim]`` per layer (K and V as ``kv[0]``/``kv[1]``), a
    GDN state stacked ``[layers, slots, ...]`` in bf16 with a degenerate short-conv field: the
    regions sit at the tensors' own addresses, the empty field is dropped, and a request moves
    between two Sessions byte-exact."""

    def engine(seed: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        kv = [random_tensor((2, 6, 4, 2, 8), torch.bfloat16, seed + i) for i in range(2)]
        state = {
            "conv": random_tensor((3, 4, 16, 3), torch.bfloat16, seed + 10),
            "ssm": random_tensor((3, 4, 2, 8, 8), torch.float32, seed + 11),
            "temporal": torch.zeros((3, 4, 0, 0, 0), dtype=torch.bfloat16),
        }
        return kv, state

    def describe(kv: list[torch.Tensor], state: dict[str, torch.Tensor]) -> xk.Manifest:
        out = xk.pools.kv_pages("kv", k=[t[0] for t in kv], v=[t[1] for t in kv], layout="NHD")
        out += xk.pools.state_pool(
            "state",
            fields=state,
            shards={"conv": xk.pools.Shard(0), "ssm": xk.pools.Shard(0), "temporal": None},
        )
        return xk.Manifest.build(out)

    src_kv, src_state = engine(1)
    dst_kv, dst_state = engine(50)
    before = [raw(t[0]).copy() for t in dst_kv]
    src, dst = describe(src_kv, src_state), describe(dst_kv, dst_state)
    assert src.region(("kv", "v", 1, 0)).addr == src_kv[1][1].data_ptr()
    assert src.region(("state", "ssm", 2, 0)).addr == src_state["ssm"][2].data_ptr()
    assert {d.key for d in src.dropped} == {("state", "temporal", i, 0) for i in range(3)}
    pre = Session(xk.open_backend("loopback"), src)
    dec = Session(xk.open_backend("loopback"), dst)
    try:
        recv = dec.expect("p", [pre.address], {"kv": [5, 0], "state": [3]})
        pre.offer("p").write({"kv": [2, 4], "state": [1]}, last=True)
        assert recv.wait(WAIT_S) is State.DONE, recv.error
    finally:
        pre.close()
        dec.close()
    for i in range(2):
        for side in (0, 1):
            np.testing.assert_array_equal(
                raw(dst_kv[i][side])[[5, 0]], raw(src_kv[i][side])[[2, 4]]
            )
        np.testing.assert_array_equal(raw(dst_kv[i][0])[[1, 2, 3, 4]], before[i][[1, 2, 3, 4]])
    for name in ("conv", "ssm"):
        got, want = dst_state[name][:, 3], src_state[name][:, 1]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
