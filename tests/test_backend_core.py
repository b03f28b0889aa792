"""The core's side of the Backend contract: batching, first-error reporting, guards, cleanup.

The conformance kit checks what every driver must do; these tests check what
the core does around a driver. They run the real loopback (with its fault
injection) and, where a path needs a driver lacking a capability or failing
in a particular way, ``MemBackend``: a small but real implementation of the
contract that copies with ``ctypes.memmove`` within this process.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

import xferkit as xk
from xferkit import (
    CONTRACT_VERSION,
    Backend,
    BoundsError,
    Capabilities,
    CapabilityError,
    Descriptors,
    Endpoint,
    Manifest,
    Notification,
    Posted,
    ProtocolError,
    Region,
    RegistrationError,
    Status,
    TransferError,
    XferError,
    open_backend,
)
from xferkit_loopback import Faults

WAIT_S = 10.0
PLAIN = Capabilities()  # cpu only, no notifications, one process, no batch limit

# -- helpers ------------------------------------------------------------------------------


def _buffer(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _manifest(arrays: list[np.ndarray], name: str) -> Manifest:
    return Manifest.build(
        [Region.from_array(a, pool=f"p{i}", name=name, layer=0) for i, a in enumerate(arrays)]
    )


def _descs(src: list[int], dst: list[int], nbytes: list[int]) -> Descriptors:
    return Descriptors(*(np.array(x, dtype=np.uint64) for x in (src, dst, nbytes)))


def _drain(backend: Backend, count: int, timeout: float = WAIT_S) -> list[Notification]:
    notes: list[Notification] = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        notes += backend.notifications()
        time.sleep(0.001)
    return notes


@dataclass
class _Post:
    descs: Descriptors
    notify: bytes | None
    job: Posted
    earlier: list[Status]  # the states of every earlier post at the moment this one was posted


class PostLog:
    """Wraps a backend's ``_post`` on the instance to record every batch the core posts."""

    def __init__(self, backend: Backend, before: Any = None) -> None:
        self.posts: list[_Post] = []
        real = backend._post

        def post(handle: Any, descs: Descriptors, notify: bytes | None) -> Posted:
            if before is not None:
                before(len(self.posts) + 1)
            earlier = [p.job.poll() for p in self.posts]
            job = real(handle, descs, notify)
            self.posts.append(_Post(descs, notify, job, earlier))
            return job

        backend._post = post  # type: ignore[method-assign]


@dataclass
class Pair:
    a: Backend  # the writer
    b: Backend  # the target
    src: np.ndarray
    dst: np.ndarray
    peer: Any

    def descs(self, count: int, size: int) -> tuple[Descriptors, np.ndarray]:
        """``count`` pieces of ``size`` bytes, written in reverse order; and the expected dst."""
        s0, d0 = self.src.ctypes.data, self.dst.ctypes.data
        src = [s0 + i * size for i in range(count)]
        dst = [d0 + (count - 1 - i) * size for i in range(count)]
        want = self.dst.copy()
        for i in range(count):
            j = count - 1 - i
            want[j * size : (j + 1) * size] = self.src[i * size : (i + 1) * size]
        return _descs(src, dst, [size] * count), want


@pytest.fixture
def loopback_pair() -> Iterator[Any]:
    """Factory: two connected loopback backends (the writer takes ``options``)."""
    opened: list[Backend] = []

    def make(size: int = 1 << 16, **options: Any) -> Pair:
        a, b = open_backend("loopback", **options), open_backend("loopback")
        opened.extend((a, b))
        src, dst = _buffer(size, 1), _buffer(size, 2)
        a.register(_manifest([src], "src"))
        b.register(_manifest([dst], "dst"))
        return Pair(a, b, src, dst, a.connect(b.endpoint(), b.manifest))

    yield make
    for backend in opened:
        backend.close()


# -- an in-test driver: a real, minimal implementation of the contract ------------------------


class _MemJob(Posted):
    def __init__(self, owner: MemBackend, target: str, descs: Descriptors, notify: bytes | None):
        self.owner, self.target, self.descs, self.notify = owner, target, descs, notify
        self.status = Status.PENDING
        self.text = ""
        self.released = False

    def run(self, fail: str | None = None) -> None:
        if fail is not None:
            self.text, self.status = fail, Status.FAILED
            return
        for s, d, n in zip(
            *(a.tolist() for a in (self.descs.src, self.descs.dst, self.descs.nbytes)), strict=True
        ):
            ctypes.memmove(d, s, n)
        if self.notify is not None:
            MemBackend.live[self.target].inbox.append(
                Notification(f"mem:{self.owner.id}", self.notify)
            )
        self.status = Status.DONE

    def poll(self) -> Status:
        return self.status

    @property
    def error(self) -> str:
        return self.text

    def release(self) -> None:
        self.released = True


class MemBackend(Backend):
    """Copies within this process with memmove; completes at once, or when told (``gated``).

    It records each driver primitive the core calls, and can be told to refuse
    registering or deregistering regions (by label) with a given exception.
    """

    name = "memtest"
    live: ClassVar[dict[str, MemBackend]] = {}

    def __init__(self, capabilities: Capabilities = PLAIN, *, gated: bool = False):
        super().__init__()
        self.capabilities = capabilities
        self.gated = gated
        self.id = uuid.uuid4().hex
        self.registered: set[tuple[int, int]] = set()
        self.calls: list[tuple] = []
        self.refuse_register: dict[str, Exception] = {}
        self.refuse_deregister: dict[str, Exception] = {}
        self.jobs: list[_MemJob] = []
        self.inbox: list[Notification] = []
        MemBackend.live[self.id] = self

    def _register_region(self, region: Region) -> None:
        self.calls.append(("register", region.label))
        if region.label in self.refuse_register:
            raise self.refuse_register[region.label]
        self.registered.add((region.addr, region.nbytes))

    def _deregister_region(self, region: Region) -> None:
        self.calls.append(("deregister", region.label))
        if region.label in self.refuse_deregister:
            raise self.refuse_deregister[region.label]
        self.registered.remove((region.addr, region.nbytes))

    def _endpoint(self) -> bytes:
        return self.id.encode()

    def _connect(self, blob: bytes, manifest: Manifest) -> tuple[str, Any]:
        self.calls.append(("connect", blob))
        return f"mem:{blob.decode()}", blob.decode()

    def _disconnect(self, handle: Any) -> None:
        self.calls.append(("disconnect", handle))

    def _post(self, handle: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        self.calls.append(("post", len(descs), notify))
        job = _MemJob(self, handle, descs, notify)
        self.jobs.append(job)
        if not self.gated:
            job.run()
        return job

    def _notifications(self) -> list[Notification]:
        out, self.inbox = self.inbox, []
        return out

    def _close(self) -> None:
        self.calls.append(("close",))
        MemBackend.live.pop(self.id, None)

    def posts(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "post"]


@pytest.fixture
def mem_pair() -> Iterator[Any]:
    """Factory: two connected MemBackends with the given capabilities."""
    opened: list[Backend] = []

    def make(caps: Capabilities = PLAIN, *, gated: bool = False):
        a, b = MemBackend(caps, gated=gated), MemBackend(caps)
        opened.extend((a, b))
        src, dst = _buffer(4096, 3), _buffer(4096, 4)
        a.register(_manifest([src], "src"))
        b.register(_manifest([dst], "dst"))
        return Pair(a, b, src, dst, a.connect(b.endpoint(), b.manifest))

    yield make
    for backend in opened:
        backend.close()


# -- batch splitting ------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "max_batch"), [(10, 3), (9, 3), (1, 4), (7, 1), (5, 8)])
def test_writes_are_split_to_max_batch_and_notify_rides_the_last(loopback_pair, count, max_batch):
    pair = loopback_pair(max_batch=max_batch)
    log = PostLog(pair.a)
    descs, want = pair.descs(count, 4096)
    pair.a.write(pair.peer, descs, notify=b"req-1 done").wait(WAIT_S)

    posts = log.posts
    assert len(posts) == math.ceil(count / max_batch)
    assert all(0 < len(p.descs) <= max_batch for p in posts)
    # The batches are the write's descriptors, in order, nothing lost or repeated.
    for field in ("src", "dst", "nbytes"):
        np.testing.assert_array_equal(
            np.concatenate([getattr(p.descs, field) for p in posts]), getattr(descs, field)
        )
    # Only the last batch carries the notification, and it went out after the others were done.
    assert [p.notify for p in posts] == [None] * (len(posts) - 1) + [b"req-1 done"]
    assert posts[-1].earlier == [Status.DONE] * (len(posts) - 1)
    np.testing.assert_array_equal(pair.dst, want)
    assert [n.message for n in _drain(pair.b, 1)] == [b"req-1 done"]


def test_notify_batch_waits_for_every_other_batch(mem_pair):
    """With completion under the test's control: no early notification, however often polled."""
    pair = mem_pair(Capabilities(notifications=True, max_batch=2), gated=True)
    descs, want = pair.descs(5, 64)
    t = pair.a.write(pair.peer, descs, notify=b"ready")
    assert [c[1:] for c in pair.a.posts()] == [(2, None), (2, None)]  # the first two, at once
    for _ in range(100):
        assert t.poll() is Status.PENDING
    assert len(pair.a.posts()) == 2
    pair.a.jobs[1].run()  # the second completes first: still one outstanding
    assert t.poll() is Status.PENDING and len(pair.a.posts()) == 2
    pair.a.jobs[0].run()
    assert t.poll() is Status.PENDING
    assert [c[1:] for c in pair.a.posts()] == [(2, None), (2, None), (1, b"ready")]
    assert pair.b.notifications() == []
    pair.a.jobs[2].run()
    assert t.poll() is Status.DONE and t.error is None
    np.testing.assert_array_equal(pair.dst, want)
    assert [n.message for n in pair.b.notifications()] == [b"ready"]
    assert all(j.released for j in pair.a.jobs)  # the core releases every batch once done


# -- first error wins ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5])
def test_first_failed_post_is_the_error(loopback_pair, k):
    pair = loopback_pair(max_batch=2, faults=Faults(fail_post_at=k))
    descs, _ = pair.descs(10, 256)  # five batches
    t = pair.a.write(pair.peer, descs, notify=b"n")
    with pytest.raises(TransferError) as info:
        t.wait(WAIT_S)
    err = info.value
    assert t.error is err and t.poll() is Status.FAILED
    assert err.subject == pair.peer.name
    assert pair.peer.name in str(err)
    assert f"injected failure of post #{k}" in err.args[0]
    with pytest.raises(TransferError) as again:  # waiting again reports the same error
        t.wait(WAIT_S)
    assert again.value is err
    assert pair.b.notifications() == []  # a failed write never notifies


def test_later_failures_are_attached_not_substituted(loopback_pair):
    """Posts #3 and #4 both fail; #3 (the first) is the error, #4 is attached to it."""
    pair = loopback_pair(max_batch=2, faults=Faults(stall_post_at=1))
    fail_at = {3, 4}

    def before(n: int) -> None:  # arm the driver's own fault for the posts we want to fail
        pair.a.faults.fail_post_at = n if n in fail_at else None

    log = PostLog(pair.a, before)
    blocker = pair.a.write(pair.peer, pair.descs(1, 64)[0])  # post #1 stalls the driver
    descs, _ = pair.descs(10, 256)
    t = pair.a.write(pair.peer, descs)  # posts #2..#5 queue behind it; #6 waits for them
    assert t.poll() is Status.PENDING
    log.posts[0].job.release()  # abort the stall: the queued posts now run
    deadline = time.monotonic() + WAIT_S
    while any(p.job.poll() is Status.PENDING for p in log.posts) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [p.job.poll() for p in log.posts[1:]] == [
        Status.DONE,
        Status.FAILED,
        Status.FAILED,
        Status.DONE,
    ]
    assert t.poll() is Status.FAILED
    err = t.error
    assert isinstance(err, TransferError)
    assert "injected failure of post #3" in err.args[0]
    assert "#4" not in err.args[0]
    assert [f.args[0] for f in err.followups] == ["injected failure of post #4"]
    text = str(err)
    assert text.index("post #3") < text.index("post #4")
    assert len(log.posts) == 5  # the last batch was never posted
    assert blocker.poll() is Status.FAILED


# -- stalls -------------------------------------------------------------------------------


def test_stalled_post_polls_without_blocking_and_close_aborts_it(loopback_pair):
    pair = loopback_pair(faults=Faults(stall_post_at=1))
    t = pair.a.write(pair.peer, pair.descs(4, 512)[0])
    start = time.monotonic()
    states = {t.poll() for _ in range(1000)}
    assert time.monotonic() - start < 0.25  # a poll that blocked would never come back
    assert states == {Status.PENDING}
    with pytest.raises(TransferError, match="still pending") as info:
        t.wait(0.05)
    assert pair.peer.name in str(info.value)
    assert t.error is None and t.poll() is Status.PENDING  # a timeout is not a failure
    start = time.monotonic()
    pair.a.close()
    assert time.monotonic() - start < 5  # the worker was freed, not abandoned
    assert t.poll() is Status.FAILED
    assert "aborted" in str(t.error)


def test_close_right_after_posting_aborts_a_stall_not_yet_started(loopback_pair):
    """The stalled post may still sit in the driver's queue when close() runs."""
    for _ in range(3):
        pair = loopback_pair(faults=Faults(stall_post_at=1))
        t = pair.a.write(pair.peer, pair.descs(1, 64)[0])
        start = time.monotonic()
        pair.a.close()
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + WAIT_S
        while t.poll() is Status.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert t.poll() is Status.FAILED


# -- dropped peers, lost notifications ---------------------------------------------------------


def test_dropped_peer_fails_then_recovers_without_blacklist(loopback_pair):
    pair = loopback_pair()
    descs, want = pair.descs(8, 1024)
    before = pair.dst.copy()
    pair.a.faults.dropped_peers.add(pair.peer.name)
    with pytest.raises(TransferError) as info:
        pair.a.write(pair.peer, descs).wait(WAIT_S)
    assert pair.peer.name in str(info.value) and "unreachable" in str(info.value)
    np.testing.assert_array_equal(pair.dst, before)
    pair.a.faults.dropped_peers.discard(pair.peer.name)
    pair.a.write(pair.peer, descs).wait(WAIT_S)  # same peer object, no reconnect
    np.testing.assert_array_equal(pair.dst, want)


def test_lost_notification_data_still_arrives(loopback_pair):
    pair = loopback_pair(faults=Faults(lose_notification_at=1))
    descs, want = pair.descs(4, 2048)
    pair.a.write(pair.peer, descs, notify=b"first").wait(WAIT_S)
    np.testing.assert_array_equal(pair.dst, want)
    pair.a.write(pair.peer, pair.descs(1, 16)[0], notify=b"second").wait(WAIT_S)
    # Notifications arrive in order; once the second is here, the first is known lost.
    assert [n.message for n in _drain(pair.b, 1)] == [b"second"]
    assert pair.b.notifications() == []


# -- refused up front, nothing posted -----------------------------------------------------------


def test_notify_without_the_capability_is_refused(mem_pair):
    pair = mem_pair(Capabilities(notifications=False))
    before = pair.dst.copy()
    with pytest.raises(CapabilityError, match="notifications"):
        pair.a.write(pair.peer, pair.descs(2, 64)[0], notify=b"done")
    assert pair.a.posts() == []
    np.testing.assert_array_equal(pair.dst, before)
    with pytest.raises(CapabilityError):
        pair.b.notifications()
    pair.a.write(pair.peer, pair.descs(2, 64)[0]).wait(WAIT_S)  # without notify it works
    assert len(pair.a.posts()) == 1


@pytest.mark.parametrize(
    "where", [(socket.gethostname(), os.getpid() + 1), ("elsewhere.invalid", os.getpid())]
)
def test_endpoint_of_another_process_needs_cross_process(where):
    host, pid = where
    with MemBackend(Capabilities(cross_process=False)) as a, MemBackend() as b:
        b.register(_manifest([_buffer(256, 5)], "dst"))
        fake = msgspec.msgpack.encode(
            Endpoint(MemBackend.name, CONTRACT_VERSION, host, pid, b._endpoint())
        )
        with pytest.raises(CapabilityError) as info:
            a.connect(fake, b.manifest)
        assert str(pid) in str(info.value) and host in str(info.value)
        assert [c for c in a.calls if c[0] == "connect"] == []
        a.connect(b.endpoint(), b.manifest)  # the same process is fine


def test_cuda_memory_on_a_cpu_only_backend_is_refused_before_the_driver():
    cpu = _buffer(256, 6)
    gpu = Region(
        pool="g",
        name="kv",
        layer=3,
        addr=1 << 40,
        nbytes=64,
        slot_shape=(64,),
        itemsize=1,
        device="cuda:0",
    )
    manifest = Manifest.build([Region.from_array(cpu, pool="c", name="x", layer=0), gpu])
    with MemBackend() as b:
        with pytest.raises(CapabilityError) as info:
            b.register(manifest)
        assert gpu.label in str(info.value) and "cuda:0" in str(info.value)
        assert info.value.subject == gpu.key
        assert b.calls == [] and b.manifest is None  # not even the cpu region was registered


# -- protocol, peers, bounds ----------------------------------------------------------------


def test_malformed_or_foreign_endpoints_are_protocol_errors(loopback_pair):
    pair = loopback_pair()
    a, m = pair.a, pair.b.manifest
    with pytest.raises(ProtocolError, match="malformed"):
        a.connect(b"certainly not an endpoint", m)
    with pytest.raises(ProtocolError, match="malformed"):
        a.connect(msgspec.msgpack.encode({"backend": "loopback"}), m)
    with MemBackend() as other:
        with pytest.raises(ProtocolError) as info:
            a.connect(other.endpoint(), m)
        assert "memtest" in str(info.value) and "loopback" in str(info.value)
    env = msgspec.msgpack.decode(pair.b.endpoint(), type=Endpoint)
    newer = msgspec.msgpack.encode(msgspec.structs.replace(env, contract=CONTRACT_VERSION + 1))
    with pytest.raises(ProtocolError, match=f"contract {CONTRACT_VERSION + 1}"):
        a.connect(newer, m)


def test_write_to_a_peer_not_connected(loopback_pair):
    pair = loopback_pair()
    third = loopback_pair()
    log = PostLog(pair.a)
    descs, _ = pair.descs(1, 64)
    with pytest.raises(XferError, match="not connected"):
        pair.a.write(third.peer, descs)  # another backend's peer
    pair.a.disconnect(pair.peer)
    with pytest.raises(XferError, match="not connected"):
        pair.a.write(pair.peer, descs)
    assert log.posts == []


def test_write_before_register_is_a_bounds_error(loopback_pair):
    pair = loopback_pair()
    with open_backend("loopback") as fresh:
        peer = fresh.connect(pair.b.endpoint(), pair.b.manifest)
        log = PostLog(fresh)
        with pytest.raises(BoundsError, match="register"):
            fresh.write(peer, pair.descs(1, 64)[0])
        assert log.posts == []


def test_malformed_descriptor_arrays_are_bounds_errors(loopback_pair):
    pair = loopback_pair()
    log = PostLog(pair.a)
    good, _ = pair.descs(2, 64)
    bad = [
        Descriptors(good.src.astype(np.int64), good.dst, good.nbytes),  # dtype
        Descriptors(good.src, good.dst, good.nbytes.astype(np.uint32)),  # dtype
        Descriptors(good.src.reshape(1, 2), good.dst.reshape(1, 2), good.nbytes.reshape(1, 2)),
        Descriptors(good.src, good.dst[:1], good.nbytes),  # lengths differ
        Descriptors(good.src.tolist(), good.dst.tolist(), good.nbytes.tolist()),  # not arrays
    ]
    for descs in bad:
        with pytest.raises(BoundsError, match="uint64"):
            pair.a.write(pair.peer, descs)
    assert log.posts == []


def test_descriptor_wrapping_around_2_64_is_refused(loopback_pair):
    pair = loopback_pair()
    log = PostLog(pair.a)
    s0, d0 = pair.src.ctypes.data, pair.dst.ctypes.data
    # src + nbytes wraps to s0 + 4: below the region's end, so only the wrap gives it away.
    descs = _descs([s0, s0 + 8], [d0, d0 + 64], [64, 2**64 - 4])
    with pytest.raises(BoundsError, match="descriptor 1: source") as info:
        pair.a.write(pair.peer, descs)
    assert info.value.subject == 1
    assert log.posts == []


def test_loopback_refuses_bad_descriptors_itself(loopback_pair):
    """Behind the core's guard the driver is strict too, like a NIC: it fails, never crashes."""
    pair = loopback_pair()
    s0, d0 = pair.src.ctypes.data, pair.dst.ctypes.data
    before = pair.dst.copy()
    cases = [
        (_descs([s0 + 8], [d0 + 8], [2**64 - 4]), f"local address {s0 + 8:#x}"),  # wraps
        (_descs([s0, 4096], [d0, d0], [8, 8]), "local address 0x1000"),
        (_descs([s0], [d0 + pair.dst.size - 4], [8]), "is not registered by"),
    ]
    for descs, text in cases:
        job = pair.a._post(pair.peer.handle, descs, None)
        deadline = time.monotonic() + WAIT_S
        while job.poll() is Status.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.poll() is Status.FAILED and text in job.error
        job.release()
    np.testing.assert_array_equal(pair.dst, before)


def test_descriptor_spanning_two_adjacent_regions_is_refused():
    src, dst = _buffer(8192, 7), _buffer(8192, 8)
    halves = lambda a: [a[:4096], a[4096:]]  # noqa: E731 - adjacent regions, one allocation
    with open_backend("loopback") as a, open_backend("loopback") as b:
        a.register(_manifest(halves(src), "src"))
        b.register(_manifest(halves(dst), "dst"))
        peer = a.connect(b.endpoint(), b.manifest)
        log = PostLog(a)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        before = dst.copy()
        with pytest.raises(BoundsError, match="source"):
            a.write(peer, _descs([s0 + 4000], [d0], [200]))
        with pytest.raises(BoundsError, match=f"destination .* advertised by peer {peer.name}"):
            a.write(peer, _descs([s0], [d0 + 4000], [200]))
        assert log.posts == []
        np.testing.assert_array_equal(dst, before)
        a.write(peer, _descs([s0 + 3900, s0 + 4096], [d0 + 3900, d0 + 4096], [196, 200])).wait(
            WAIT_S
        )  # the same bytes, split at the boundary, go through
        np.testing.assert_array_equal(dst[3900:4296], src[3900:4296])


# -- registration rollback ----------------------------------------------------------------


def test_rollback_failure_is_attached_to_the_first_registration_error():
    arrays = [_buffer(256, 10 + i) for i in range(4)]
    m = _manifest(arrays, "r")
    labels = [r.label for r in m.regions]
    refused = RuntimeError("driver: out of memory keys")
    stuck = RuntimeError("driver: region busy")
    with MemBackend() as b:
        b.refuse_register[labels[2]] = refused
        b.refuse_deregister[labels[0]] = stuck
        with pytest.raises(RegistrationError) as info:
            b.register(m)
        err = info.value
        assert labels[2] in err.args[0] and "out of memory keys" in err.args[0]
        assert "busy" not in err.args[0]
        assert err.subject == m.regions[2].key and err.__cause__ is refused
        assert err.followups == [stuck]
        assert "region busy" in str(err)
        # Rolled back newest first, every one that had succeeded.
        assert b.calls == [
            ("register", labels[0]),
            ("register", labels[1]),
            ("register", labels[2]),
            ("deregister", labels[1]),
            ("deregister", labels[0]),
        ]
        assert b.manifest is None
        assert b.registered == {(m.regions[0].addr, m.regions[0].nbytes)}  # the stuck one


# -- cleanup ------------------------------------------------------------------------------


def test_deregister_and_close_are_idempotent_and_release_once():
    m = _manifest([_buffer(128, 20), _buffer(64, 21)], "c")
    with MemBackend() as a, MemBackend() as b:
        b.register(_manifest([_buffer(64, 22)], "d"))
        a.register(m)
        peer = a.connect(b.endpoint(), b.manifest)
        a.deregister()
        a.deregister()
        assert [c for c in a.calls if c[0] == "deregister"] == [
            ("deregister", r.label) for r in reversed(m.regions)
        ]
        assert a.registered == set() and a.manifest is None
        a.register(m)
        a.close()
        a.close()
        assert a.calls[-4:] == [
            ("disconnect", peer.handle),
            ("deregister", m.regions[1].label),
            ("deregister", m.regions[0].label),
            ("close",),
        ]
        assert a.calls.count(("close",)) == 1
        for use in (lambda: a.register(m), a.endpoint, lambda: a.connect(b.endpoint(), m)):
            with pytest.raises(XferError, match="closed"):
                use()


def test_context_manager_closes_even_on_error():
    m = _manifest([_buffer(128, 23)], "c")
    with pytest.raises(KeyError), MemBackend() as b:
        b.register(m)
        raise KeyError("boom")
    assert ("close",) in b.calls and b.registered == set()
    with open_backend("loopback") as lb:
        lb.register(m)
    with pytest.raises(XferError, match="closed"):
        lb.endpoint()
    with open_backend("loopback") as again:  # the loopback released the memory
        again.register(m)


def test_deregister_reports_the_first_failure_and_attaches_the_rest():
    m = _manifest([_buffer(64, 30 + i) for i in range(3)], "x")
    with MemBackend() as b:
        b.register(m)
        first, second = RuntimeError("first refusal"), RuntimeError("second refusal")
        b.refuse_deregister = {m.regions[2].label: first, m.regions[0].label: second}
        with pytest.raises(RegistrationError) as info:
            b.deregister()
        assert m.regions[2].label in info.value.args[0]
        assert "first refusal" in info.value.args[0]
        assert info.value.followups == [second]
        assert b.manifest is None
        b.refuse_deregister = {}


# -- the error family -----------------------------------------------------------------------


def test_attach_keeps_the_first_error_and_lists_the_later_ones():
    err = TransferError("write to peer p failed: link down", subject="p")
    assert str(err) == "write to peer p failed: link down" and err.followups == []
    later = [ValueError("queue flushed"), XferError("retry refused")]
    for e in later:
        err.attach(e)
    assert err.followups == later
    assert err.args[0] == "write to peer p failed: link down"
    assert str(err) == (
        "write to peer p failed: link down (then 2 later error(s) it caused: "
        "ValueError: queue flushed; XferError: retry refused)"
    )
    assert err.subject == "p"


def test_fault_counters_run_across_transfers(loopback_pair):
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


# -- descriptors a plan made for exactly these manifests ------------------------------


def _planned_pair():
    """Two loopback backends holding a 2 -> 2 KV layout, and a plan between them."""
    from xferkit.testing import Reference, RegionSpec

    spec = RegionSpec(pool="kv", name="k", layer=0, shape=(4, 8), tp_axis=0)
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 8}, dst_slots={"kv": 8})
    a, b = xk.open_backend("loopback"), xk.open_backend("loopback")
    a.register(ref.srcs[0].manifest)
    b.register(ref.dsts[0].manifest)
    return ref, a, b


def test_planned_descriptors_skip_the_bounds_scan_only_when_provably_in_bounds(monkeypatch):
    import xferkit.backend as core

    ref, a, b = _planned_pair()
    scans = []
    real = core._inside
    monkeypatch.setattr(core, "_inside", lambda *args: scans.append(1) or real(*args))
    request = {"kv": ([1, 2, 3], [5, 6, 7])}
    with a, b:
        dst_manifest = ref.dsts[0].manifest
        descs = xk.plan(ref.srcs[0].manifest, dst_manifest).expand(request)
        assert descs.origin == (ref.srcs[0].manifest, dst_manifest)
        with pytest.raises(ValueError):
            descs.src[0] = 0  # read-only: what the plan proved stays true
        with pytest.raises(ValueError):
            descs.dst.setflags(write=True)  # and cannot simply be unlocked
        peer = a.connect(b.endpoint(), dst_manifest)
        a.write(peer, descs).wait(10)
        assert scans == []  # proven by construction: no scan
        ref.check(0, request)
        # The peer advertised an equal manifest, but not the one planned for: scan.
        twin = xk.Manifest.decode(dst_manifest.encode())
        a.write(a.connect(b.endpoint(), twin), descs).wait(10)
        assert len(scans) == 2


def test_forged_or_unlocked_descriptors_lose_the_seal_and_are_refused():
    ref, a, b = _planned_pair()
    with a, b:
        dst_manifest = ref.dsts[0].manifest
        descs = xk.plan(ref.srcs[0].manifest, dst_manifest).expand({"kv": ([1], [5])})
        peer = a.connect(b.endpoint(), dst_manifest)
        far = descs.dst + np.uint64(1 << 40)
        far.setflags(write=False)
        forged = [
            Descriptors(descs.src, far, descs.nbytes),  # new arrays, even read-only ones
            Descriptors(descs.src, descs.dst, descs.nbytes),  # rewrapped: no seal either
        ]
        tampered = xk.plan(ref.srcs[0].manifest, dst_manifest).expand({"kv": ([1], [5])})
        tampered.dst = far  # an array swapped in
        for d in (*forged, tampered):
            assert d.origin is None
        for d in (forged[0], tampered):
            with pytest.raises(xk.BoundsError):
                a.write(peer, d)


def test_sealed_descriptors_still_meet_the_drivers_smallest_transfer():
    ref, a, b = _planned_pair()
    with a, b:
        a.capabilities = msgspec.structs.replace(a.capabilities, min_transfer=1 << 20)
        dst_manifest = ref.dsts[0].manifest
        descs = xk.plan(ref.srcs[0].manifest, dst_manifest).expand({"kv": ([1], [5])})
        assert descs.origin is not None
        with pytest.raises(xk.BoundsError, match="moves at least"):
            a.write(a.connect(b.endpoint(), dst_manifest), descs)


# -- failures in the middle of things ---------------------------------------------------


def test_a_refused_post_after_a_failed_batch_is_attached_to_that_failure(mem_pair):
    """The earlier batch's failure is the root cause; the refusal it provoked comes second."""
    p = mem_pair(Capabilities(max_batch=2), gated=True)
    a = p.a
    real_post = a._post
    posts = []

    def post(handle, descs, notify):
        posts.append(descs)
        if len(posts) == 2:
            a.jobs[0].run(fail="connection reset by peer (root cause)")
            raise RuntimeError("endpoint is in error state")
        return real_post(handle, descs, notify)

    a._post = post
    base_s, base_d = p.src.ctypes.data, p.dst.ctypes.data
    t = a.write(p.peer, _descs([base_s] * 5, [base_d + 8 * i for i in range(5)], [8] * 5))
    with pytest.raises(TransferError) as info:
        t.wait(5)
    err = info.value
    assert "root cause" in str(err).split("(then")[0]
    assert [str(e) for e in err.followups] == [
        "posting 2 descriptors failed: endpoint is in error state"
    ]


class _BatchRaises(MemBackend):
    """A driver whose batch registration registers some regions, then raises."""

    def _register_batch(self, regions):
        for r in regions[:2]:
            self._register_region(r)
        raise RuntimeError("engine refused kv/r2[0]")


def test_a_raising_batch_registration_rolls_back_everything_it_may_have_held():
    bufs = [_buffer(256, i) for i in range(4)]
    b = _BatchRaises()
    with pytest.raises(RegistrationError, match="engine refused") as info:
        b.register(_manifest(bufs, "r"))
    assert "raised instead of naming the failing region" in str(info.value)
    assert b.registered == set() and b.manifest is None
    b.close()


def test_extra_results_from_a_batch_registration_are_ignored():
    class TooMany(MemBackend):
        def _register_batch(self, regions):
            return [*super()._register_batch(regions), None, None]

    b = TooMany()
    m = _manifest([_buffer(64, 1)], "r")
    b.register(m)
    assert b.manifest is m
    b.close()


def test_close_runs_every_step_and_reports_the_first_failure():
    a, b = MemBackend(), MemBackend()
    a.register(_manifest([_buffer(64, 1)], "src"))
    b.register(_manifest([_buffer(64, 2)], "dst"))
    a.connect(b.endpoint(), b.manifest)

    def broken_disconnect(handle):
        raise RuntimeError("disconnect failed")

    def broken_close():
        raise RuntimeError("close failed (secondary)")

    a._disconnect = broken_disconnect
    a.refuse_deregister = {"p0/src[0]": RuntimeError("deregister failed")}
    a._close = broken_close
    with pytest.raises(RuntimeError, match="disconnect failed"):
        a.close()
    # Deregistration and the driver's close still ran, although disconnecting failed first.
    assert ("deregister", "p0/src[0]") in a.calls
    a.close()  # idempotent, even after a failed close
    b.close()


def test_close_attaches_later_failures_to_a_first_xfer_error():
    a = MemBackend()
    a.register(_manifest([_buffer(64, 1)], "src"))
    a.refuse_deregister = {"p0/src[0]": RuntimeError("deregister failed")}

    def broken_close():
        raise RuntimeError("close failed (secondary)")

    a._close = broken_close
    with pytest.raises(RegistrationError, match="deregister failed") as info:
        a.close()
    assert [str(e) for e in info.value.followups] == ["close failed (secondary)"]
