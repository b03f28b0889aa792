"""The loopback's own failures, injected with ``Faults``, as an engine meets them.

The core's handling of failures is tested on the mock driver (tests/core);
these check that the loopback fails for real the way an RDMA engine does
(its own text, its own worker, its own checks on every descriptor) and that
those failures come out of the core as they should.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from xferkit import (
    Backend,
    Descriptors,
    Peer,
    ProtocolError,
    RegistrationError,
    Status,
    TransferError,
    XferError,
    open_backend,
)
from xferkit.testing.conformance import drain_until
from xferkit.testing.memory import descriptors, manifest_of, random_bytes
from xferkit_loopback import Faults
from xferkit_loopback.backend import LoopbackDriver

WAIT_S = 10.0


def _driver(backend: Backend) -> LoopbackDriver:
    driver = backend.driver
    assert isinstance(driver, LoopbackDriver)
    return driver


@dataclass
class Pair:
    a: Backend  # the writer
    b: Backend  # the target
    src: np.ndarray
    dst: np.ndarray
    peer: Peer

    @property
    def faults(self) -> Faults:
        return _driver(self.a).faults

    def descs(self, count: int, size: int) -> tuple[Descriptors, np.ndarray]:
        """``count`` pieces of ``size`` bytes, written in reverse order; and the dst expected."""
        s0, d0 = self.src.ctypes.data, self.dst.ctypes.data
        src = [s0 + i * size for i in range(count)]
        dst = [d0 + (count - 1 - i) * size for i in range(count)]
        want = self.dst.copy()
        for i in range(count):
            j = count - 1 - i
            want[j * size : (j + 1) * size] = self.src[i * size : (i + 1) * size]
        return descriptors(src, dst, [size] * count), want


@pytest.fixture
def loopback_pair() -> Iterator[Callable[..., Pair]]:
    """Factory: two connected loopback backends (the writer takes ``options``)."""
    opened: list[Backend] = []

    def make(size: int = 1 << 16, **options: Any) -> Pair:
        a, b = open_backend("loopback", **options), open_backend("loopback")
        opened.extend((a, b))
        src, dst = random_bytes(size, 1), random_bytes(size, 2)
        a.register(manifest_of([src], "src"))
        b.register(manifest_of([dst], "dst"))
        assert b.manifest is not None
        return Pair(a, b, src, dst, a.connect(b.endpoint(), b.manifest))

    yield make
    for backend in opened:
        backend.close()


# -- registration ---------------------------------------------------------------------


@pytest.mark.parametrize("at", [1, 2, 4])
def test_a_refused_registration_is_rolled_back_inside_the_driver(at: int) -> None:
    m = manifest_of([random_bytes(4096, i) for i in range(4)], "r")
    with open_backend("loopback") as b:
        _driver(b).faults.fail_register_at = at
        with pytest.raises(RegistrationError) as info:
            b.register(m)
        assert m.regions[at - 1].label in str(info.value)
        assert f"injected failure of registration #{at}" in str(info.value)
        assert b.manifest is None
        _driver(b).faults.fail_register_at = None
        b.register(m)  # the loopback refuses a range registered twice: none was left behind
        assert b.manifest is m


# -- posts ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_failed_post_carries_the_drivers_text(loopback_pair: Callable[..., Pair], k: int) -> None:
    pair = loopback_pair(max_batch=2, faults=Faults(fail_post_at=k))
    t = pair.a.write(pair.peer, pair.descs(10, 256)[0], notify=b"n")  # five batches
    with pytest.raises(TransferError) as info:
        t.wait(WAIT_S)
    assert f"injected failure of post #{k}" in info.value.args[0]
    assert pair.peer.name in info.value.args[0]
    assert pair.b.notifications(timeout=0.05) == []  # a failed write never notifies


def test_fault_counters_run_across_transfers(loopback_pair: Callable[..., Pair]) -> None:
    """The loopback's post counter is per backend: post #3 is the third overall."""
    pair = loopback_pair(faults=Faults(fail_post_at=3))
    results = []
    for _ in range(4):
        try:
            pair.a.write(pair.peer, pair.descs(1, 64)[0]).wait(WAIT_S)
            results.append("ok")
        except TransferError as exc:
            results.append(exc.args[0].rsplit(": ", 1)[-1])
    assert results == ["ok", "ok", "injected failure of post #3", "ok"]


def test_a_stalled_post_polls_without_blocking_and_close_frees_the_worker(
    loopback_pair: Callable[..., Pair],
) -> None:
    pair = loopback_pair(faults=Faults(stall_post_at=1))
    t = pair.a.write(pair.peer, pair.descs(4, 512)[0])
    start = time.monotonic()
    states = {t.poll() for _ in range(1000)}
    assert time.monotonic() - start < 5  # a poll that blocked would never come back
    assert states == {Status.PENDING}
    start = time.monotonic()
    pair.a.close()
    assert time.monotonic() - start < 5  # the worker was freed, not abandoned
    assert t.poll() is Status.FAILED
    assert "closed" in str(t.error)


def test_close_right_after_posting_aborts_a_stall_not_yet_started(
    loopback_pair: Callable[..., Pair],
) -> None:
    """The stalled post may still sit in the driver's queue when close() runs."""
    for _ in range(3):
        pair = loopback_pair(faults=Faults(stall_post_at=1))
        t = pair.a.write(pair.peer, pair.descs(1, 64)[0])
        start = time.monotonic()
        pair.a.close()
        assert time.monotonic() - start < 5
        assert t.poll() is Status.FAILED


def test_a_dropped_peer_fails_then_recovers_without_reconnecting(
    loopback_pair: Callable[..., Pair],
) -> None:
    pair = loopback_pair()
    descs, want = pair.descs(8, 1024)
    before = pair.dst.copy()
    pair.faults.dropped_peers.add(pair.peer.name)
    with pytest.raises(TransferError) as info:
        pair.a.write(pair.peer, descs).wait(WAIT_S)
    assert pair.peer.name in str(info.value) and "unreachable" in str(info.value)
    np.testing.assert_array_equal(pair.dst, before)
    pair.faults.dropped_peers.discard(pair.peer.name)
    pair.a.write(pair.peer, descs).wait(WAIT_S)  # same peer object, no reconnect
    np.testing.assert_array_equal(pair.dst, want)


def test_a_lost_notification_still_delivers_the_data(loopback_pair: Callable[..., Pair]) -> None:
    pair = loopback_pair(faults=Faults(lose_notification_at=1))
    descs, want = pair.descs(4, 2048)
    pair.a.write(pair.peer, descs, notify=b"first").wait(WAIT_S)
    np.testing.assert_array_equal(pair.dst, want)
    pair.a.write(pair.peer, pair.descs(1, 16)[0], notify=b"second").wait(WAIT_S)
    # Notifications arrive in order; once the second is here, the first is known lost.
    assert [n.message for n in drain_until(pair.b, 1, WAIT_S)] == [b"second"]
    assert pair.b.notifications() == []


# -- the driver's own checks ------------------------------------------------------------


def test_the_loopback_refuses_bad_descriptors_itself(loopback_pair: Callable[..., Pair]) -> None:
    """Behind the core's guard the driver is strict too, like a NIC: it fails, never crashes."""
    pair = loopback_pair()
    driver = _driver(pair.a)
    assert pair.b.manifest is not None
    link = driver.connect(_driver(pair.b).endpoint(), pair.b.manifest)  # the primitive itself
    s0, d0 = pair.src.ctypes.data, pair.dst.ctypes.data
    before = pair.dst.copy()
    cases = [
        (descriptors([s0 + 8], [d0 + 8], [2**64 - 4]), f"local address {s0 + 8:#x}"),  # wraps
        (descriptors([s0, 4096], [d0, d0], [8, 8]), "local address 0x1000"),
        (descriptors([s0], [d0 + pair.dst.size - 4], [8]), "is not registered by"),
    ]
    for descs, text in cases:
        job = driver.post(link, descs, None)
        deadline = time.monotonic() + WAIT_S
        while job.poll() is Status.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.poll() is Status.FAILED and text in job.error
        job.release()
    np.testing.assert_array_equal(pair.dst, before)


# -- what the core now does for the loopback -----------------------------------------------


def test_notifications_after_close_are_an_xfer_error_not_a_closed_socket() -> None:
    b = open_backend("loopback")
    b.close()
    with pytest.raises(XferError, match="closed"):
        b.notifications()


def test_a_garbage_loopback_blob_is_a_protocol_error(loopback_pair: Callable[..., Pair]) -> None:
    pair = loopback_pair()
    assert pair.b.manifest is not None
    fields = msgspec.msgpack.decode(pair.b.endpoint())
    fields["blob"] = {"pid": "not a pid", "id": 7, "regions": "all of them"}
    with pytest.raises(ProtocolError, match="malformed endpoint blob"):
        pair.a.connect(msgspec.msgpack.encode(fields), pair.b.manifest)


def test_a_reregistered_peer_makes_the_old_peer_stale(loopback_pair: Callable[..., Pair]) -> None:
    """Its endpoint (the registered ranges) changed under the same address: reconnect."""
    pair = loopback_pair()
    moved = random_bytes(1 << 16, 3)
    pair.b.deregister()
    pair.b.register(manifest_of([moved], "dst"))
    assert pair.b.manifest is not None
    fresh = pair.a.connect(pair.b.endpoint(), pair.b.manifest)
    assert fresh.name == pair.peer.name
    descs, _ = pair.descs(2, 64)
    with pytest.raises(TransferError, match="stale"):
        pair.a.write(pair.peer, descs)
    s0, d0 = pair.src.ctypes.data, moved.ctypes.data
    pair.a.write(fresh, descriptors([s0], [d0], [64])).wait(WAIT_S)
    np.testing.assert_array_equal(moved[:64], pair.src[:64])
