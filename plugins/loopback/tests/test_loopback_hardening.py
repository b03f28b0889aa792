"""The loopback refuses like a NIC (issue 9): stale endpoints, reused PIDs, full receivers, drops.

Each test here failed before the fix it names: writes through a stale endpoint
landed, a reused PID was written, 989 of 1000 writes failed when the receiver
had not drained, one stalled peer blocked every other, a dropped backend kept
its thread and socket forever, and 10k regions took seconds to register.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

import xferkit as xk
from xferkit.testing.peer import PeerProcess, Reregister, Setup
from xferkit.testing.reference import Reference, RegionSpec
from xferkit_loopback import Faults

WAIT_S = 10.0


def _manifest(array: np.ndarray, name: str = "buf") -> xk.Manifest:
    return xk.Manifest.build([xk.Region.from_array(array, pool="p", name=name, layer=0)])


def _copy(src: np.ndarray, dst: np.ndarray, n: int) -> xk.Descriptors:
    return xk.Descriptors(
        np.array([src.ctypes.data], np.uint64),
        np.array([dst.ctypes.data], np.uint64),
        np.array([n], np.uint64),
    )


def test_a_stale_endpoint_in_this_process_is_refused() -> None:
    """The peer deregistered and registered again: the old endpoint's remote key is dead."""
    src = np.full(4096, 7, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    with xk.open_backend("loopback") as a, xk.open_backend("loopback") as b:
        a.register(_manifest(src))
        b.register(_manifest(dst))
        peer = a.connect(b.endpoint(), _manifest(dst))
        b.deregister()
        dst[:] = 0
        other = np.zeros(4096, dtype=np.uint8)
        b.register(_manifest(other))
        t = a.write(peer, _copy(src, dst, 4096))
        with pytest.raises(xk.TransferError, match="stale remote key"):
            t.wait(WAIT_S)
        assert not dst.any() and not other.any()
        # The new endpoint works.
        fresh = a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        a.write(fresh, _copy(src, other, 4096)).wait(WAIT_S)
        assert (other == 7).all()


def _raw_setup(slots: int) -> Setup:
    spec = RegionSpec(pool="raw", name="buf", layer=0, shape=(4096,), itemsize=1)
    return Setup(
        backend="loopback",
        options={},
        specs=[spec],
        src_tp=1,
        dst_tp=1,
        src_slots={"raw": slots},
        dst_slots={"raw": slots},
        role="dst",
        index=0,
    )


def test_a_stale_endpoint_in_another_process_is_refused() -> None:
    setup = _raw_setup(4)
    ref = Reference(setup.specs, src_tp=1, dst_tp=1, src_slots={"raw": 4}, dst_slots={"raw": 4})
    with xk.open_backend("loopback") as a, PeerProcess() as proc:
        a.register(ref.srcs[0].manifest)
        ready = proc.ask(setup)
        dst = xk.Manifest.decode(ready.manifest)
        peer = a.connect(ready.endpoint, dst)
        again = proc.ask(Reregister())
        assert again.ok, again.error
        descs = xk.plan(ref.srcs[0].manifest, dst).expand({"raw": ([0], [1])})
        with pytest.raises(xk.TransferError, match="stale remote key"):
            a.write(peer, descs).wait(WAIT_S)
        fresh = a.connect(again.endpoint, dst)
        a.write(fresh, descs).wait(WAIT_S)


def test_a_reused_pid_is_never_written() -> None:
    """An endpoint naming a pid that now belongs to another process is refused at connect."""
    dst = np.zeros(64, dtype=np.uint8)
    with xk.open_backend("loopback") as a, PeerProcess() as proc:
        a.register(_manifest(np.ones(64, dtype=np.uint8)))
        ready = proc.ask(_raw_setup(1))
        stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            envelope = msgspec.msgpack.decode(ready.endpoint)  # the blob is a nested map
            envelope["blob"]["pid"] = stranger.pid  # a recycled pid: same number, new process
            envelope["pid"] = stranger.pid
            forged = msgspec.msgpack.encode(envelope)
            with pytest.raises(xk.XferError, match="another process"):
                a.connect(forged, xk.Manifest.decode(ready.manifest))
        finally:
            stranger.kill()
            stranger.wait()
    assert not dst.any()


def test_an_exited_peer_is_reported_not_written() -> None:
    setup = _raw_setup(2)
    ref = Reference(setup.specs, src_tp=1, dst_tp=1, src_slots={"raw": 2}, dst_slots={"raw": 2})
    with xk.open_backend("loopback") as a:
        a.register(ref.srcs[0].manifest)
        proc = PeerProcess()
        ready = proc.ask(setup)
        dst = xk.Manifest.decode(ready.manifest)
        peer = a.connect(ready.endpoint, dst)
        proc.kill()
        descs = xk.plan(ref.srcs[0].manifest, dst).expand({"raw": ([0], [1])})
        with pytest.raises(xk.TransferError, match=r"exited|gone"):
            a.write(peer, descs).wait(WAIT_S)


def test_a_thousand_notified_writes_complete_before_the_receiver_drains() -> None:
    """Before: the receiver's datagram queue held 11, and 989 of 1000 writes FAILED."""
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    with xk.open_backend("loopback") as a, xk.open_backend("loopback") as b:
        a.register(_manifest(src))
        b.register(_manifest(dst))
        peer = a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        transfers = []
        for i in range(1000):
            d = xk.Descriptors(
                np.array([src.ctypes.data + i], np.uint64),
                np.array([dst.ctypes.data + i], np.uint64),
                np.array([1], np.uint64),
            )
            transfers.append(a.write(peer, d, notify=b"%d" % i))
        for t in transfers:
            t.wait(WAIT_S)
        assert all(t.poll() is xk.Status.DONE for t in transfers)
        notes: list[xk.Notification] = []
        deadline = time.monotonic() + WAIT_S
        while len(notes) < 1000 and time.monotonic() < deadline:
            notes += b.notifications(timeout=0.1)
        assert sorted(int(n.message) for n in notes) == list(range(1000))
        np.testing.assert_array_equal(dst, src)


def test_a_stalled_peer_does_not_hold_back_the_others() -> None:
    """One worker per peer: no head-of-line blocking across peers."""
    src = np.ones(64, dtype=np.uint8)
    one, two = np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    with (
        xk.open_backend("loopback", faults=Faults(stall_post_at=1)) as a,
        xk.open_backend("loopback") as b,
        xk.open_backend("loopback") as c,
    ):
        a.register(_manifest(src))
        b.register(_manifest(one))
        c.register(_manifest(two))
        stalled = a.write(a.connect(b.endpoint(), b.manifest), _copy(src, one, 64))  # type: ignore[arg-type]
        a.write(a.connect(c.endpoint(), c.manifest), _copy(src, two, 64)).wait(WAIT_S)  # type: ignore[arg-type]
        assert (two == 1).all()
        assert stalled.poll() is xk.Status.PENDING
        stalled.abort()
        assert stalled.poll() is xk.Status.FAILED and not one.any()


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("xferkit-loopback")}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_backend_dropped_without_close_is_reclaimed() -> None:
    gc.collect()
    threads, fds = _threads(), _fds()
    for _ in range(5):
        a, b = xk.open_backend("loopback"), xk.open_backend("loopback")
        buf = np.zeros(64, dtype=np.uint8)
        a.register(_manifest(buf))
        b.register(_manifest(np.zeros(64, dtype=np.uint8)))
        a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        del a, b
        gc.collect()
    deadline = time.monotonic() + WAIT_S
    while (_threads() - threads or _fds() > fds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() - threads == set()
    assert _fds() <= fds
