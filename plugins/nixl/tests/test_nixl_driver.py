"""What the NIXL driver adds to the conformance kit: its own failures, paths and set-up.

Everything runs a real NIXL agent (UCX on host memory); nothing is mocked
except ``find_spec`` in the availability test. Where a test needs to see or
bend a primitive, it subclasses the driver (``Recording``, ``NullSecond``)
and wraps it in a ``Backend``, as a plugin author would.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
import xferkit_nixl
from xferkit.driver import Posted, Status
from xferkit.testing.conformance import drain_until, require_backend
from xferkit.testing.peer import PeerProcess
from xferkit.testing.reference import RegionSpec
from xferkit_nixl.backend import NixlDriver, NixlOptions
from xferkit_nixl.memory import Kinds, memory_kind, split_by_kind
from xferkit_nixl.ucx_env import apply_defaults, ucx_modules_default

require_backend("nixl")

PAGE = 4096


class Recording(NixlDriver):
    """The NIXL driver, keeping every batch it posted (the core releases them; they stay here)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(NixlOptions(**options))
        self.posts = 0
        self.posted: list[Posted] = []

    def post(self, link: Any, descs: xk.Descriptors, notify: bytes | None) -> Posted:
        self.posts += 1
        posted = super().post(link, descs, notify)
        self.posted.append(posted)
        return posted


def _manifest(arrays: dict[str, np.ndarray]) -> xk.Manifest:
    return xk.Manifest.build(
        [xk.Region.from_array(a, pool="kv", name=n, layer=0) for n, a in arrays.items()]
    )


def _descs(pairs: list[tuple[int, int, int]]) -> xk.Descriptors:
    src, dst, n = zip(*pairs, strict=True)
    return xk.Descriptors(*(np.array(x, dtype=np.uint64) for x in (src, dst, n)))


def _sender(backend: xk.Backend) -> str:
    """How a receiver names ``backend`` in its notifications (and its peers name it)."""
    return f"nixl:{backend.driver.address}"


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

    def region(name: str, addr: int, device: str) -> xk.Region:
        return xk.Region(
            pool="kv", name=name, layer=0, addr=addr, nbytes=1 << 20, slot_shape=(4096,),
            itemsize=1, device=device,
        )  # fmt: skip

    def kinds(m: xk.Manifest) -> Kinds:
        return Kinds.of([r.device for r in m.regions], m.locate)

    local = kinds(xk.Manifest.build([region("a", 1 << 40, "cuda:3"), region("b", 1 << 30, "cpu")]))
    remote = kinds(xk.Manifest.build([region("a", 1 << 41, "cuda:1"), region("b", 1 << 31, "cpu")]))
    assert local.kinds == [("DRAM", 0), ("VRAM", 3)]
    assert remote.kinds == [("DRAM", 0), ("VRAM", 1)]
    d = _descs(
        [
            ((1 << 40) + 4096, (1 << 41) + 64, 100),  # VRAM 3 -> VRAM 1
            ((1 << 30) + 8, (1 << 41), 50),  # DRAM -> VRAM 1
            ((1 << 40), (1 << 31) + 4096, 10),  # VRAM 3 -> DRAM
            ((1 << 40) + 8192, (1 << 41) + 8192, 7),  # VRAM 3 -> VRAM 1 again
        ]
    )
    groups = {(lk, rk): part for lk, rk, part in split_by_kind(local, remote, d)}
    assert sorted(groups) == [
        (("DRAM", 0), ("VRAM", 1)),
        (("VRAM", 3), ("DRAM", 0)),
        (("VRAM", 3), ("VRAM", 1)),
    ]
    assert groups[(("VRAM", 3), ("VRAM", 1))].nbytes.tolist() == [100, 7]
    assert groups[(("DRAM", 0), ("VRAM", 1))].src.tolist() == [(1 << 30) + 8]
    # One kind on each side (the usual case): the descriptors go out as they are.
    cpu = kinds(_manifest({"x": np.zeros(64, np.uint8)}))
    ((lk, rk, same),) = split_by_kind(cpu, cpu, d)
    assert (lk, rk) == (("DRAM", 0), ("DRAM", 0)) and same is d


def test_ucx_modules_default_follows_the_rdma_devices() -> None:
    assert ucx_modules_default({})[0] == "^ib"
    assert ucx_modules_default({"mlx5_0": "mlx5_core", "mlx5_1": "mlx5_core"})[0] == "^efa"
    value, why = ucx_modules_default({"mlx5_0": "mlx5_core", "rdmap16s27": "efa"})
    assert value is None and "rdmap16s27" in why
    env: dict[str, str] = {}
    notes = apply_defaults(env, devices={})
    mutex = {"UCX_USE_MT_MUTEX": "y"}
    assert env == {"UCX_MODULES": "^ib", "UCX_LOG_FILE": "stderr"} | mutex
    assert any("UCX_MODULES=^ib" in n for n in notes)
    mine = {"UCX_MODULES": "*", "UCX_LOG_FILE": "/tmp/ucx.log", "UCX_USE_MT_MUTEX": "n"}
    env = dict(mine)
    apply_defaults(env, devices={})
    assert env == mine  # the user's choices stay
    env = {}
    apply_defaults(env, devices={"rdmap16s27": ""})  # an EFA device: UCX_MODULES left unset
    assert env == {"UCX_LOG_FILE": "stderr"} | mutex


# -- availability ------------------------------------------------------------------------


def test_listed_available_here() -> None:
    (info,) = [b for b in xk.backends() if b.name == "nixl"]
    assert info.available, info.reason
    assert info.distribution == "xferkit-nixl"


def test_opening_an_agent_imports_no_torch() -> None:
    """NIXL's meta package imports torch to learn the CUDA version when it cannot read one
    (a CPU build of torch installed here): 1.3 s per fresh rank, 5 s with six starting at
    once. With one compiled wheel installed the driver imports that wheel directly. A process
    that already imported torch (an engine) loses nothing either way."""
    code = (
        "import sys, xferkit as xk\n"
        "b = xk.open_backend('nixl'); b.close()\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False", "opening a NIXL agent imported torch"


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


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        ({"post": "prepared"}, "post"),  # the prepared-list path is gone
        ({"backends": "UCX"}, "backends"),
        ({"backends": []}, "backends"),
        ({"backends": ["NOPE"]}, "NOPE"),
        ({"agent_prefix": ""}, "agent_prefix"),
        ({"max_batch": -1}, "max_batch"),
        ({"max_batch": 2.5}, "max_batch"),
        ({"progress_thread": 1}, "progress_thread"),
        ({"progress_delay_us": -5}, "progress_delay_us"),
    ],
)
def test_bad_options_are_option_errors_naming_the_option(
    options: dict[str, Any], culprit: str
) -> None:
    with pytest.raises(xk.OptionError, match=culprit):
        xk.open_backend("nixl", **options)


def test_an_unknown_nixl_backend_is_refused_naming_what_exists() -> None:
    with pytest.raises(xk.OptionError) as info:
        xk.open_backend("nixl", backends=["NOSUCH"])
    assert "NOSUCH" in str(info.value) and "UCX" in str(info.value)


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


_LONG_WRITE = """
import time, numpy as np, xferkit as xk
n = 128 << 20
src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
    a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="x", layer=0)]))
    m = xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="x", layer=0)])
    b.register(m)
    peer = a.connect(b.endpoint(), m)
    d = xk.Descriptors(*(np.array([x], np.uint64) for x in (src.ctypes.data, dst.ctypes.data, n)))
    a.write(peer, d).wait(30)
    wall = cpu = 0.0
    for _ in range(5):
        w, c = time.monotonic(), time.process_time()
        a.write(peer, d).wait(30)
        wall, cpu = wall + time.monotonic() - w, cpu + time.process_time() - c
    assert (dst == 1).all()
    print(cpu / wall)
"""


def test_no_thread_spins_while_a_long_write_copies() -> None:
    """On host memory UCX copies inside the worker's lock; NIXL's progress thread, woken
    meanwhile, waits for that lock. With UCX's default spinlock it burned a second core for
    the whole copy (this process: 1.93-1.96 CPU seconds per second of writing); it sleeps now
    (1.1). CPU per wall second, not speed: a busy machine can only lower it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run(
        [sys.executable, "-c", _LONG_WRITE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout) < 1.5


# -- registration ---------------------------------------------------------------------------


class NullSecond(NixlDriver):
    """Hands NIXL a NULL address for the second region, which NIXL really refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def register_region(self, region: xk.Region) -> None:
        self.calls += 1
        super().register_region(
            msgspec.structs.replace(region, addr=0) if self.calls == 2 else region
        )


def test_registration_failure_carries_nixls_text_and_rolls_back() -> None:
    bufs = {n: np.zeros(2 * PAGE, np.uint8) for n in ("a", "b", "c")}
    m = _manifest(bufs)
    with xk.Backend(NullSecond()) as b, xk.open_backend("nixl") as a:
        with pytest.raises(xk.RegistrationError) as info:
            b.register(m)
        text = str(info.value)
        assert m.regions[1].label in text and "nixlBackendError: NIXL_ERR_BACKEND" in text
        cause = info.value.__cause__
        assert cause is not None and type(cause.__cause__).__name__ == "nixlBackendError"
        assert b.manifest is None
        assert not b.driver._regs  # type: ignore[attr-defined]  # the first was rolled back
        # Nothing is left half-registered, and the agent's metadata still loads and works.
        b.register(m)
        src = np.arange(PAGE, dtype=np.uint8)
        a.register(_manifest({"s": src}))
        peer = a.connect(b.endpoint(), m)
        a.write(peer, _descs([(src.ctypes.data, bufs["b"].ctypes.data + 8, PAGE)])).wait(10)
        np.testing.assert_array_equal(bufs["b"][8 : 8 + PAGE], src)


# -- writes ---------------------------------------------------------------------------------


def _paged(seed: int, pages: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: rng.integers(0, 256, (pages, PAGE), dtype=np.uint8) for n in ("k", "v")}
    out["state"] = rng.integers(0, 256, (pages, 512), dtype=np.uint8)
    return out


def test_paged_writes_are_byte_exact() -> None:
    """Whole pages, single and coalesced runs, pieces within a page, after re-registering."""
    src, dst = _paged(1, 16), _paged(2, 24)
    want = {n: a.copy() for n, a in dst.items()}
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        a.register(_manifest(src))
        dm = _manifest(dst)
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
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
        assert [n.message for n in drain_until(b, 1, 10)] == [b"pages"]
        # A piece within a page (a head slice, say).
        head = src["k"]
        a.write(peer, _descs([(head.ctypes.data + 100, dst["k"].ctypes.data + 7, 1000)])).wait(10)
        want["k"].reshape(-1)[7:1007] = head.reshape(-1)[100:1100]
        np.testing.assert_array_equal(dst["k"], want["k"])
        # A new local region set: the memory kinds are looked up in the new one.
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
    driver = Recording()
    with xk.Backend(driver) as a, xk.open_backend("nixl") as b:
        a.register(_manifest({"s": src}))
        dm = _manifest({"d": dst})
        b.register(dm)
        peer = a.connect(b.endpoint(), dm)
        descs = xk.Descriptors(
            np.uint64(src.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size),
            np.uint64(dst.ctypes.data) + order * np.uint64(size),
            np.full(n, size, np.uint64),
        )
        a.write(peer, descs).wait(30)
        assert driver.posts == 1
    got = dst[: n * size].reshape(n, size)[order.astype(np.int64)]
    np.testing.assert_array_equal(got, src[: n * size].reshape(n, size))


def test_split_writes_release_every_request_and_a_refused_post_leaves_nothing() -> None:
    src, dst = np.arange(3 * PAGE, dtype=np.uint8), np.zeros(3 * PAGE, np.uint8)
    driver = Recording(max_batch=1)
    with xk.Backend(driver) as a:
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
        assert [n.message for n in drain_until(b, 1, 10)] == [b"three"]
        assert len(driver.posted) == 3
        for posted in driver.posted:  # released by the core, and still answering
            assert posted._handles == []  # type: ignore[attr-defined]  # NIXL's freed
            assert posted.poll() is Status.DONE
        b.close()
        t = a.write(peer, pages)
        with pytest.raises(xk.TransferError, match="nixlRemoteDisconnectError") as info:
            t.wait(10)
        assert peer.name in str(info.value)
        # NIXL refused the first post itself: nothing was handed to the core, nothing runs.
        assert driver.posts == 4 and len(driver.posted) == 3


def test_a_pending_request_released_by_abort_reports_failed() -> None:
    """A frozen peer keeps UCX's connection set-up, so the request, pending; abort releases it."""
    specs = [RegionSpec(pool="p", name="buf", layer=0, shape=(1 << 16,), itemsize=1)]
    src = np.full((4, 1 << 16), 7, np.uint8)
    driver = Recording()
    with PeerProcess() as proc, xk.Backend(driver) as a:
        endpoint, dm = proc.receiver("nixl", specs, 4)
        a.register(_manifest({"buf": src}))
        peer = a.connect(endpoint, dm)
        whole = _descs([(src.ctypes.data, dm.regions[0].addr, src.nbytes)])
        with proc.frozen():
            t = a.write(peer, whole, b"never")
            time.sleep(0.5)
            assert t.poll() is xk.Status.PENDING
            t.abort("test: abort a pending write")
            assert t.poll() is xk.Status.FAILED
            (posted,) = driver.posted
            # Released while pending: FAILED, answered without calling into the freed handle.
            assert posted.poll() is Status.FAILED and "released" in posted.error
        a.write(peer, whole).wait(10)  # the connection still works


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
            assert peer.name == _sender(b)
            sender.write(peer, xk.Descriptors.empty(), notify=_sender(sender).encode()).wait(10)
        notes = drain_until(b, 2, 10)
        assert sorted((n.peer, n.message) for n in notes) == sorted(
            (_sender(s), _sender(s).encode()) for s in (a, c)
        )
        # An empty message still arrives (NIXL drops an empty notif_msg on a write).
        peer = a.connect(b.endpoint(), dm)
        a.write(peer, _descs([(kept[a]["k"].ctypes.data, bufs["k"].ctypes.data, 64)]), b"").wait(10)
        assert [(n.peer, n.message) for n in drain_until(b, 1, 10)] == [(_sender(a), b"")]


def _loaded(backend: xk.Backend, agent: str) -> bool:
    """Whether ``backend``'s NIXL agent holds metadata for ``agent``."""
    return bool(backend.driver._agent.check_remote_metadata(agent))  # type: ignore[attr-defined]


def test_reconnect_after_the_peer_registered_anew() -> None:
    """Same agent name, new metadata: the old is removed, the new loaded, old peers go stale."""
    src = np.arange(PAGE, dtype=np.uint8)
    first, second = np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        agent = b.driver.address
        a.register(_manifest({"s": src}))
        m1 = _manifest({"d": first})
        b.register(m1)
        old = a.connect(b.endpoint(), m1)
        twin = a.connect(b.endpoint(), m1)  # a second peer on the same agent
        a.write(old, _descs([(src.ctypes.data, first.ctypes.data, 100)])).wait(10)
        a.disconnect(twin)  # the agent's metadata stays while `old` uses it
        assert _loaded(a, agent)
        a.write(old, _descs([(src.ctypes.data, first.ctypes.data, PAGE)])).wait(10)
        np.testing.assert_array_equal(first, src)
        b.deregister()
        m2 = _manifest({"d": second})
        b.register(m2)
        new = a.connect(b.endpoint(), m2)
        assert new.name == old.name
        # Retiring the old connection did not remove the metadata that replaced it.
        assert _loaded(a, agent)
        a.write(new, _descs([(src.ctypes.data, second.ctypes.data, PAGE)]), b"again").wait(10)
        np.testing.assert_array_equal(second, src)
        assert [n.message for n in drain_until(b, 1, 10)] == [b"again"]
        with pytest.raises(xk.TransferError, match="stale"):
            a.write(old, _descs([(src.ctypes.data, first.ctypes.data, 64)]))
        a.disconnect(new)  # the last peer on the agent: its metadata stays (see the kit's fd test)
        assert _loaded(a, agent)
        again = a.connect(b.endpoint(), m2)  # ...and serves the next connection as it is
        a.write(again, _descs([(src.ctypes.data, second.ctypes.data + 8, 64)])).wait(10)
        np.testing.assert_array_equal(second[8:72], src[:64])


def test_an_endpoint_naming_another_agent_is_a_protocol_error() -> None:
    """Metadata under a different name than the endpoint claims is refused, and unloaded."""
    dst = np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        dm = _manifest({"d": dst})
        b.register(dm)
        real = b.driver.endpoint()
        forged = msgspec.structs.replace(real, name="someone-else")
        with pytest.raises(xk.ProtocolError, match="someone-else") as info:
            a.driver.connect(forged, dm)
        assert b.driver.address in str(info.value)
        assert not _loaded(a, b.driver.address) and not _loaded(a, "someone-else")
        # Metadata naming an agent that is not even UTF-8 (NIXL loads it): refused the same way.
        metadata = real.metadata  # type: ignore[attr-defined]
        at = metadata.find(b.driver.address.encode())
        assert at >= 0
        mangled = msgspec.structs.replace(
            real, metadata=metadata[:at] + b"\xff" + metadata[at + 1 :]
        )
        with pytest.raises(xk.ProtocolError, match=b.driver.address):
            a.driver.connect(mangled, dm)
        assert not _loaded(a, b.driver.address)
        src = np.full(PAGE, 3, np.uint8)
        a.register(_manifest({"s": src}))
        peer = a.connect(b.endpoint(), dm)  # the real endpoint still connects
        a.write(peer, _descs([(src.ctypes.data, dst.ctypes.data, PAGE)])).wait(10)
        assert (dst == 3).all()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_metadata_is_an_xferkit_error_and_leaves_nothing_loaded(
    nixl_pair: tuple[xk.Backend, xk.Backend, xk.Manifest], data: st.DataObject
) -> None:
    """Garbage or truncated metadata in a well-formed blob: an XferError, never a raw one.

    Not bit flips: one inside the UCX worker address trips an assertion in UCX
    that aborts the process (see docs/nixl.md, traps).
    """
    a, b, dm = nixl_pair
    real = b.driver.endpoint()
    metadata = real.metadata  # type: ignore[attr-defined]
    fuzzed = data.draw(
        st.one_of(
            st.binary(max_size=2048),
            st.integers(0, len(metadata) - 1).map(lambda n: metadata[:n]),
        )
    )
    with contextlib.suppress(xk.XferError):  # anything else fails the test
        a.driver.disconnect(a.driver.connect(msgspec.structs.replace(real, metadata=fuzzed), dm))
    assert not a.driver._remotes  # type: ignore[attr-defined]
    assert not _loaded(a, b.driver.address)


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[tuple[xk.Backend, xk.Backend, xk.Manifest]]:
    dst = np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        dm = _manifest({"d": dst})
        b.register(dm)
        yield a, b, dm


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
        assert "unreachable" in str(info.value)  # the table's hint


def _unmappable(size: int) -> tuple[np.ndarray, Callable[[], object]]:
    """A buffer from mmap and the call that unmaps it (so that reading it faults for sure)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
    return array, lambda: libc.munmap(addr, size)


def test_a_failed_endpoint_recovers_on_the_next_write() -> None:
    """A fault fails NIXL's endpoint to a live peer; the next post reloads the peer's metadata."""
    dst = np.zeros(PAGE, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        dm = _manifest({"d": dst})
        b.register(dm)
        src, unmap = _unmappable(1 << 20)
        src[:] = 7
        a.register(_manifest({"s": src.reshape(-1, PAGE)}))
        peer = a.connect(b.endpoint(), dm)
        twin = a.connect(b.endpoint(), dm)
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
        a.write(peer, again).wait(10)  # NIXL would keep the failed endpoint; the driver reloads
        assert (dst == 9).all()
        good[:] = 11
        a.write(twin, again).wait(10)  # the other peer on that agent shares the fresh endpoint
        assert (dst == 11).all()
