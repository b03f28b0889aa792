"""What the NIXL driver adds to the conformance kit: its own failures, paths and set-up.

Everything runs a real NIXL agent (UCX on host memory); nothing is mocked
except ``find_spec`` in the availability test.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from drivers import require_nixl

import xferkit as xk
import xferkit_nixl
from xferkit_nixl.memory import memory_kind
from xferkit_nixl.ucx_env import apply_defaults, ucx_modules_default

require_nixl()

PAGE = 4096


def _manifest(arrays: dict[str, np.ndarray]) -> xk.Manifest:
    return xk.Manifest.build(
        [xk.Region.from_array(a, pool="kv", name=n, layer=0) for n, a in arrays.items()]
    )


def _descs(pairs: list[tuple[int, int, int]]) -> xk.Descriptors:
    src, dst, n = zip(*pairs, strict=True)
    return xk.Descriptors(*(np.array(x, dtype=np.uint64) for x in (src, dst, n)))


def _drain(backend: xk.Backend, count: int, timeout: float = 10.0) -> list[xk.Notification]:
    notes: list[xk.Notification] = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        notes += backend.notifications()
        time.sleep(0.001)
    return notes


# -- pure mappings -------------------------------------------------------------------


def test_memory_kind_mapping() -> None:
    assert memory_kind("cpu") == ("DRAM", 0)
    assert memory_kind("cuda:0") == ("VRAM", 0)
    assert memory_kind("cuda:3") == ("VRAM", 3)
    for bad in ("cuda", "tpu:0", "cpu:1"):
        with pytest.raises(ValueError, match=bad):
            memory_kind(bad)


def test_mixed_memory_kinds_are_split_into_one_request_per_kind_pair() -> None:
    """A NIXL list holds one memory type: cpu and cuda:N descriptors go out separately."""
    from xferkit_nixl.backend import _Side, _split_by_kind

    def region(name: str, addr: int, device: str) -> xk.Region:
        return xk.Region(
            pool="kv", name=name, layer=0, addr=addr, nbytes=1 << 20, slot_shape=(4096,),
            itemsize=1, device=device,
        )  # fmt: skip

    local = _Side(xk.Manifest.build([region("a", 1 << 40, "cuda:3"), region("b", 1 << 30, "cpu")]))
    remote = _Side(xk.Manifest.build([region("a", 1 << 41, "cuda:1"), region("b", 1 << 31, "cpu")]))
    assert local.uniform is None and remote.kinds == [("DRAM", 0), ("VRAM", 1)]
    d = _descs(
        [
            ((1 << 40) + 4096, (1 << 41) + 64, 100),  # VRAM 3 -> VRAM 1
            ((1 << 30) + 8, (1 << 41), 50),  # DRAM -> VRAM 1
            ((1 << 40), (1 << 31) + 4096, 10),  # VRAM 3 -> DRAM
            ((1 << 40) + 8192, (1 << 41) + 8192, 7),  # VRAM 3 -> VRAM 1 again
        ]
    )
    groups = {(lk, rk): part for lk, rk, part in _split_by_kind(local, remote, d)}
    assert sorted(groups) == [
        (("DRAM", 0), ("VRAM", 1)),
        (("VRAM", 3), ("DRAM", 0)),
        (("VRAM", 3), ("VRAM", 1)),
    ]
    assert groups[(("VRAM", 3), ("VRAM", 1))].nbytes.tolist() == [100, 7]
    assert groups[(("DRAM", 0), ("VRAM", 1))].src.tolist() == [(1 << 30) + 8]


def test_ucx_modules_default_follows_the_rdma_devices() -> None:
    assert ucx_modules_default({})[0] == "^ib"
    assert ucx_modules_default({"mlx5_0": "mlx5_core", "mlx5_1": "mlx5_core"})[0] == "^efa"
    value, why = ucx_modules_default({"mlx5_0": "mlx5_core", "rdmap16s27": "efa"})
    assert value is None and "rdmap16s27" in why
    env: dict[str, str] = {}
    notes = apply_defaults(env, devices={})
    assert env == {"UCX_MODULES": "^ib", "UCX_LOG_FILE": "stderr"}
    assert any("UCX_MODULES=^ib" in n for n in notes)
    env = {"UCX_MODULES": "*", "UCX_LOG_FILE": "/tmp/ucx.log"}
    apply_defaults(env, devices={})
    assert env == {"UCX_MODULES": "*", "UCX_LOG_FILE": "/tmp/ucx.log"}  # the user's choice stays


# -- availability ------------------------------------------------------------------------


def test_listed_available_here() -> None:
    (info,) = [b for b in xk.backends() if b.name == "nixl"]
    assert info.available, info.reason
    assert info.distribution == "xferkit-nixl"


def test_probe_reason_when_nixl_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    xk.backends()  # discover the plugins before find_spec is patched
    real = importlib.util.find_spec

    def missing(name: str, *args, **kwargs):
        if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    (info,) = [b for b in xk.backends() if b.name == "nixl"]
    assert not info.available
    assert info.reason == (
        "nixl is not installed (pip install --no-deps nixl-cu12 nixl; it declares torch, "
        "which must not be pulled on CPU machines)"
    )
    with pytest.raises(xk.PluginError, match="pip install --no-deps nixl-cu12 nixl"):
        xk.open_backend("nixl")
    assert xferkit_nixl.INSTALL == "pip install --no-deps nixl-cu12 nixl"


def test_bad_options_are_refused() -> None:
    with pytest.raises(xk.PluginError, match="post="):
        xk.open_backend("nixl", post="fastest")
    with pytest.raises(xk.PluginError, match="NOPE"):
        xk.open_backend("nixl", backends=["NOPE"])


# -- the process-exit crash ---------------------------------------------------------------

_CHILD = """
import numpy as np, xferkit as xk
a, b = xk.open_backend("nixl"), xk.open_backend("nixl")
src, dst = np.arange(65536, dtype=np.uint8), np.zeros(65536, np.uint8)
a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="x", layer=0)]))
m = xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="x", layer=0)])
b.register(m)
peer = a.connect(b.endpoint(), m)
d = xk.Descriptors(*(np.array([x], np.uint64) for x in (src.ctypes.data, dst.ctypes.data, 65536)))
a.write(peer, d, notify=b"n").wait(10)
assert (dst == src).all()
print("moved", end=" ")
{CLOSE_CODE}
print("ok")
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "left-open"])
def test_process_exits_cleanly(close: bool) -> None:
    """A process that used the plugin exits 0, not 139, and prints nothing of NIXL's on stdout."""
    code = _CHILD.replace("{CLOSE_CODE}", "a.close(); b.close()" if close else "pass")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == "moved ok\n"
    assert "NIXL INFO" in proc.stderr  # NIXL's own log went to stderr


# -- registration ---------------------------------------------------------------------------


def test_registration_failure_carries_nixls_text_and_rolls_back() -> None:
    """NIXL really refuses the second region (a NULL address reaches register_memory)."""
    bufs = {n: np.zeros(2 * PAGE, np.uint8) for n in ("a", "b", "c")}
    m = _manifest(bufs)
    with xk.open_backend("nixl") as b, xk.open_backend("nixl") as a:
        real = b._register_region
        calls: list[xk.Region] = []

        def null_second(region: xk.Region) -> None:
            calls.append(region)
            real(msgspec.structs.replace(region, addr=0) if len(calls) == 2 else region)

        b._register_region = null_second  # type: ignore[method-assign]
        with pytest.raises(xk.RegistrationError) as info:
            b.register(m)
        del b._register_region
        text = str(info.value)
        assert m.regions[1].label in text and "nixlBackendError: NIXL_ERR_BACKEND" in text
        assert type(info.value.__cause__.__cause__).__name__ == "nixlBackendError"
        assert b.manifest is None and not b._regs  # the first region was rolled back
        # Nothing is left half-registered, and the agent's metadata still loads and works.
        b.register(m)
        src = np.arange(PAGE, dtype=np.uint8)
        a.register(_manifest({"s": src}))
        peer = a.connect(b.endpoint(), m)
        a.write(peer, _descs([(src.ctypes.data, bufs["b"].ctypes.data + 8, PAGE)])).wait(10)
        np.testing.assert_array_equal(bufs["b"][8 : 8 + PAGE], src)


# -- posting paths ------------------------------------------------------------------------------


def _paged(seed: int, pages: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: rng.integers(0, 256, (pages, PAGE), dtype=np.uint8) for n in ("k", "v")}
    out["state"] = rng.integers(0, 256, (pages, 512), dtype=np.uint8)
    return out


@pytest.mark.parametrize("post", ["prepared", "initialize"])
def test_paths_are_byte_exact_and_prepared_lists_are_used(post: str) -> None:
    src, dst = _paged(1, 16), _paged(2, 24)
    want = {n: a.copy() for n, a in dst.items()}
    with xk.open_backend("nixl", post=post) as a, xk.open_backend("nixl") as b:
        a.register(_manifest(src))
        dm = _manifest(dst)
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
        # Whole pages, single and coalesced runs, in every region.
        pairs, rng = [], np.random.default_rng(3)
        for name, arr in src.items():
            slot = arr.shape[1]
            for s, d, k in ((0, 5, 1), (3, 20, 3), (9, 0, 2), (14, 23, 1)):
                s += int(rng.integers(0, 2))
                pairs.append(
                    (arr.ctypes.data + s * slot, dst[name].ctypes.data + d * slot, k * slot)
                )
                want[name][d : d + k] = arr[s : s + k]
        a.write(peer, _descs(pairs), notify=b"pages").wait(10)
        for name in dst:
            np.testing.assert_array_equal(dst[name], want[name])
        expected = {"prepared": (1, 0), "initialize": (0, 1)}[post]
        assert (a.posts["prepared"], a.posts["initialize"]) == expected
        # A piece within a page (a head slice, say) matches no prepared entry: fallback.
        k = src["k"]
        a.write(peer, _descs([(k.ctypes.data + 100, dst["k"].ctypes.data + 7, 1000)])).wait(10)
        want["k"].reshape(-1)[7:1007] = k.reshape(-1)[100:1100]
        np.testing.assert_array_equal(dst["k"], want["k"])
        assert a.posts["initialize"] == expected[1] + 1
        assert [n.message for n in _drain(b, 1)] == [b"pages"]
        # A new local region set: the lists are prepared anew from it.
        a.deregister()
        src2 = _paged(4, 16)
        a.register(_manifest(src2))
        kk = src2["k"]
        a.write(peer, _descs([(kk.ctypes.data, dst["k"].ctypes.data, 2 * PAGE)])).wait(10)
        np.testing.assert_array_equal(dst["k"][:2], kk[:2])


def test_many_descriptors_in_one_request() -> None:
    src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    n, size = 16384, 64
    order = np.random.default_rng(6).permutation(n).astype(np.uint64)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        a.register(_manifest({"s": src}))
        dm = _manifest({"d": dst})
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
        descs = xk.Descriptors(
            np.uint64(src.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size),
            np.uint64(dst.ctypes.data) + order * np.uint64(size),
            np.full(n, size, np.uint64),
        )
        t = a.write(peer, descs)
        t.wait(30)
        assert a.posts["initialize"] == 1
    got = dst[: n * size].reshape(n, size)[order.astype(np.int64)]
    np.testing.assert_array_equal(got, src[: n * size].reshape(n, size))


# -- peers ------------------------------------------------------------------------------------


def test_notifications_name_the_sending_agent() -> None:
    bufs = _paged(7, 4)
    with (
        xk.open_backend("nixl") as a,
        xk.open_backend("nixl") as c,
        xk.open_backend("nixl") as b,
    ):
        dm = _manifest(bufs)
        b.register(dm)
        kept = {sender: _paged(8, 4) for sender in (a, c)}  # registered memory must live on
        for sender in (a, c):
            sender.register(_manifest(kept[sender]))
            peer = sender.connect(b.endpoint(), dm)
            assert peer.name == b.agent_name
            sender.write(peer, xk.Descriptors.empty(), notify=sender.agent_name.encode()).wait(10)
        notes = _drain(b, 2)
        assert sorted((n.peer, n.message) for n in notes) == sorted(
            (s.agent_name, s.agent_name.encode()) for s in (a, c)
        )
        # An empty message still arrives (NIXL drops an empty notif_msg on a write).
        peer = a.connect(b.endpoint(), dm)
        a.write(peer, _descs([(kept[a]["k"].ctypes.data, bufs["k"].ctypes.data, 64)]), b"").wait(10)
        assert [(n.peer, n.message) for n in _drain(b, 1)] == [(a.agent_name, b"")]


def test_reconnect_after_the_peer_registered_anew() -> None:
    """Same agent name, new metadata: the old is removed before the new is loaded."""
    src = np.arange(PAGE, dtype=np.uint8)
    first, second = np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        a.register(_manifest({"s": src}))
        m1 = _manifest({"d": first})
        b.register(m1)
        old = a.connect(b.endpoint(), m1)
        twin = a.connect(b.endpoint(), m1)  # a second peer on the same agent
        a.write(old, _descs([(src.ctypes.data, first.ctypes.data, 100)])).wait(10)
        a.disconnect(twin)  # the agent's metadata stays while `old` uses it
        a.write(old, _descs([(src.ctypes.data, first.ctypes.data, PAGE)])).wait(10)
        np.testing.assert_array_equal(first, src)
        b.deregister()
        m2 = _manifest({"d": second})
        b.register(m2)
        new = a.connect(b.endpoint(), m2)
        assert new.name == old.name
        a.write(new, _descs([(src.ctypes.data, second.ctypes.data, PAGE)]), b"again").wait(10)
        np.testing.assert_array_equal(second, src)
        assert [n.message for n in _drain(b, 1)] == [b"again"]
        # The old peer's memory is gone from the agent's metadata: NIXL says so.
        with pytest.raises(xk.TransferError, match="nixlNotFoundError") as info:
            a.write(old, _descs([(src.ctypes.data, first.ctypes.data, 64)])).wait(10)
        assert old.name in str(info.value)
        assert type(info.value.__cause__.__cause__).__name__ == "nixlNotFoundError"


def test_closed_peer_error_is_nixls_own() -> None:
    src, dst = np.arange(PAGE, dtype=np.uint8), np.zeros(PAGE, np.uint8)
    a = xk.open_backend("nixl")
    b = xk.open_backend("nixl")
    with a:
        a.register(_manifest({"s": src}))
        dm = _manifest({"d": dst})
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
        b.close()
        t = a.write(peer, _descs([(src.ctypes.data, dst.ctypes.data, 64)]))
        with pytest.raises(xk.TransferError) as info:
            t.wait(10)
        assert peer.name in str(info.value)
        assert "nixlRemoteDisconnectError" in str(info.value)


def _unmappable(size: int) -> tuple[np.ndarray, object]:
    """A buffer from mmap and the call that unmaps it (so that reading it faults for sure)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
    return array, lambda: libc.munmap(addr, size)


def test_a_failed_endpoint_recovers_by_connecting_again() -> None:
    """A fault fails NIXL's endpoint to a live peer; connecting again to it resets it."""
    dst = np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        dm = _manifest({"d": dst})
        b.register(dm)
        src, unmap = _unmappable(1 << 20)
        src[:] = 7
        a.register(_manifest({"s": src.reshape(-1, PAGE)}))
        peer = a.connect(b.endpoint(), dm)
        a.write(peer, _descs([(src.ctypes.data, dst.ctypes.data, PAGE)])).wait(10)
        assert (dst == 7).all()
        unmap()  # registered memory that no longer exists: UCX fails the endpoint
        with pytest.raises(xk.TransferError, match="nixlRemoteDisconnectError") as info:
            a.write(peer, _descs([(src.ctypes.data, dst.ctypes.data, PAGE)])).wait(10)
        assert peer.name in str(info.value)
        a.deregister()
        good = np.full(PAGE, 9, np.uint8)
        a.register(_manifest({"s": good}))
        again = _descs([(good.ctypes.data, dst.ctypes.data, PAGE)])
        with pytest.raises(xk.TransferError):  # NIXL keeps the failed endpoint...
            a.write(peer, again).wait(10)
        peer2 = a.connect(b.endpoint(), dm)  # ...until the peer is connected again
        a.write(peer2, again).wait(10)
        assert (dst == 9).all()
        a.write(peer, again).wait(10)  # the older peer object shares the fresh endpoint


def test_requests_are_released_on_completion_and_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from xferkit_nixl import backend as nixl_backend

    released: list[object] = []
    real = nixl_backend._Xfer.release

    def counting(self) -> None:
        released.append(self)
        real(self)

    monkeypatch.setattr(nixl_backend._Xfer, "release", counting)
    src, dst = np.arange(3 * PAGE, dtype=np.uint8), np.zeros(3 * PAGE, np.uint8)
    with xk.open_backend("nixl", max_batch=1) as a:
        b = xk.open_backend("nixl")
        a.register(_manifest({"s": src.reshape(3, PAGE)}))
        dm = _manifest({"d": dst.reshape(3, PAGE)})
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
        pages = _descs(
            [(src.ctypes.data + i * PAGE, dst.ctypes.data + i * PAGE, PAGE) for i in range(3)]
        )
        a.write(peer, pages, b"three").wait(10)  # three batches, the notification on the last
        np.testing.assert_array_equal(dst, src)
        assert a.posts["initialize"] == 3 and len(released) == 3
        assert all(x._handles == [] for x in released)  # NIXL's handles were freed
        b.close()
        t = a.write(peer, pages)
        with pytest.raises(xk.TransferError, match="nixlRemoteDisconnectError"):
            t.wait(10)
        # The failed post released what it had made; nothing is left in flight.
        assert t._posted == [] and a.posts["initialize"] == 4


def test_an_unknown_nixl_backend_is_refused_naming_what_exists() -> None:
    with pytest.raises(xk.PluginError) as info:
        xk.open_backend("nixl", backends=["NOSUCH"])
    assert "NOSUCH" in str(info.value) and "UCX" in str(info.value)
