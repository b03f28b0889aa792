"""The loopback backend: RDMA semantics (registration, async posts, notifications) on CPU memory.

It is deliberately strict, like a real engine: it refuses zero-length and
overlapping registrations and checks every descriptor against the memory
registered on both ends, so tests catch what Mooncake or NIXL would reject.
Copies run on a worker thread (the C helper releases the GIL); another
process is written with process_vm_writev; notifications travel as datagrams
on an abstract unix socket, sent only after the data is in place.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import uuid
import weakref
from bisect import bisect_left
from typing import Any, NamedTuple

import msgspec
import numpy as np

from xferkit import (
    Backend,
    BatchWorker,
    Capabilities,
    Descriptors,
    Manifest,
    Notification,
    Posted,
    QueuedBatch,
    Region,
)

from .copy import allow_writers, copy_local, explain, write_remote
from .faults import Faults

_LIVE: dict[str, weakref.ref[LoopbackBackend]] = {}  # this process's backends, by id


class _Blob(msgspec.Struct, frozen=True):
    pid: int
    id: str
    regions: list[tuple[int, int]]  # registered [start, end) at the time of endpoint()


class _PeerHandle(NamedTuple):
    name: str
    pid: int
    id: str
    address: bytes
    starts: np.ndarray
    ends: np.ndarray


class _Job(QueuedBatch):
    __slots__ = ("fail", "peer", "released", "stall")

    def __init__(self, peer: _PeerHandle, descs: Descriptors, notify: bytes | None) -> None:
        super().__init__(descs, notify)
        self.peer = peer
        self.fail: str | None = None  # injected failure text
        self.stall = False
        self.released = threading.Event()

    def release(self) -> None:
        super().release()
        self.released.set()  # also ends a stall


def _address(backend_id: str) -> bytes:
    return b"\0xferkit-loopback-" + backend_id.encode()


def _outside(addrs: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> int:
    """Index of the first piece not inside one range, or -1."""
    if not addrs.size:
        return -1
    if not starts.size:
        return 0
    where = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ends_at = addrs + nbytes
    ok = (where >= 0) & (ends_at >= addrs)  # the second catches uint64 wrap-around
    ok &= ends_at <= ends[np.maximum(where, 0)]
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else -1


class LoopbackBackend(Backend):
    name = "loopback"

    def __init__(self, *, faults: Faults | None = None, max_batch: int = 0) -> None:
        super().__init__()
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}), notifications=True, cross_process=True, max_batch=max_batch
        )
        self.faults = faults if faults is not None else Faults()
        self.id = uuid.uuid4().hex[:16]
        self.peer_name = f"loopback:{os.getpid()}:{self.id}"
        self._ranges: list[tuple[int, int]] = []  # registered [start, end), sorted
        self._arrays = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        self._registrations = itertools.count(1)
        self._posts = itertools.count(1)
        self._notes = itertools.count(1)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_address(self.id))
        self._sock.setblocking(False)
        self._stalled: set[_Job] = set()
        self._worker = BatchWorker(self._execute, name=f"xferkit-loopback-{self.id}")
        allow_writers()
        _LIVE[self.id] = weakref.ref(self)

    # -- registration: refuses what an RDMA engine refuses ----------------

    def _register_region(self, region: Region) -> None:
        start, end = region.addr, region.addr + region.nbytes
        if region.nbytes <= 0:
            raise ValueError("loopback does not support zero length memory region")
        n = next(self._registrations)
        if n == self.faults.fail_register_at:
            raise RuntimeError(f"injected failure of registration #{n} [{start:#x}, {end:#x})")
        with self._lock:
            i = bisect_left(self._ranges, (start, end))
            if (i > 0 and self._ranges[i - 1][1] > start) or (
                i < len(self._ranges) and self._ranges[i][0] < end
            ):
                raise ValueError(f"[{start:#x}, {end:#x}) overlaps memory already registered")
            self._ranges.insert(i, (start, end))
            self._refresh()

    def _deregister_region(self, region: Region) -> None:
        with self._lock:
            try:
                self._ranges.remove((region.addr, region.addr + region.nbytes))
            except ValueError:
                raise ValueError(
                    f"[{region.addr:#x}, +{region.nbytes}) is not registered"
                ) from None
            self._refresh()

    def _refresh(self) -> None:
        table = np.array(self._ranges, dtype=np.uint64).reshape(-1, 2)
        self._arrays = (table[:, 0].copy(), table[:, 1].copy())

    # -- peers ---------------------------------------------------------------

    def _endpoint(self) -> bytes:
        # Carries what is registered now: a peer in another process checks its writes
        # against it, like a NIC against remote keys. Hand out endpoints after register().
        with self._lock:
            return msgspec.msgpack.encode(_Blob(os.getpid(), self.id, list(self._ranges)))

    def _connect(self, blob: bytes, manifest: Manifest) -> tuple[str, Any]:
        b = msgspec.msgpack.decode(blob, type=_Blob)
        table = np.array(b.regions, dtype=np.uint64).reshape(-1, 2)
        name = f"loopback:{b.pid}:{b.id}"
        return name, _PeerHandle(name, b.pid, b.id, _address(b.id), table[:, 0], table[:, 1])

    # -- posting ---------------------------------------------------------------

    def _post(self, handle: _PeerHandle, descs: Descriptors, notify: bytes | None) -> Posted:
        job = _Job(handle, descs, notify)
        n = next(self._posts)
        if n == self.faults.fail_post_at:
            job.fail = f"injected failure of post #{n}"
        if n == self.faults.stall_post_at:
            job.stall = True
            self._stalled.add(job)  # known at once, so close() aborts it even before it runs
        self._worker.post(job)
        return job

    def _execute(self, job: _Job) -> str | None:
        peer, d = job.peer, job.descs
        if job.stall:
            job.released.wait()
            self._stalled.discard(job)
            return "stalled post aborted"
        if peer.name in self.faults.dropped_peers:
            return f"peer {peer.name} is unreachable (connection dropped)"
        if job.fail is not None:
            return job.fail
        local = _outside(d.src, d.nbytes, *self._arrays)
        if local >= 0:
            return f"local address {int(d.src[local]):#x} is not registered"
        same_process = peer.pid == os.getpid()
        if same_process:
            ref = _LIVE.get(peer.id)
            target = ref() if ref is not None else None
            if target is None:
                return f"peer {peer.name} is closed"
            starts, ends = target._arrays
        else:
            starts, ends = peer.starts, peer.ends
        remote = _outside(d.dst, d.nbytes, starts, ends)
        if remote >= 0:
            return f"remote address {int(d.dst[remote]):#x} is not registered by {peer.name}"
        if same_process:
            copy_local(d.src, d.dst, d.nbytes)
        elif d.src.size:
            err, index = write_remote(peer.pid, d.src, d.dst, d.nbytes)
            if err:
                return f"descriptor {index}: {explain(err, peer.pid)}"
        if job.notify is not None and next(self._notes) != self.faults.lose_notification_at:
            try:
                self._sock.sendto(
                    msgspec.msgpack.encode((self.peer_name, job.notify)), peer.address
                )
            except OSError as exc:
                return f"data written, but the notification to {peer.name} failed: {exc}"
        return None

    def _notifications(self) -> list[Notification]:
        out = []
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return out
            sender, message = msgspec.msgpack.decode(data, type=tuple[str, bytes])
            out.append(Notification(sender, message))

    def _close(self) -> None:
        for job in list(self._stalled):
            job.released.set()
        self._worker.stop()
        self._worker.join(timeout=10)
        self._sock.close()
        _LIVE.pop(self.id, None)
