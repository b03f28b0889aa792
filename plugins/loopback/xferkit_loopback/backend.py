"""The loopback driver: RDMA semantics (registration, async posts, notifications) on CPU memory.

It is deliberately strict, like a real engine: it checks every descriptor
against the memory registered on both ends when the batch runs, so tests
catch what Mooncake or NIXL would reject. Copies run on a worker thread (the
C helper releases the GIL); another process is written with
process_vm_writev; notifications travel as datagrams on an abstract unix
socket, sent only after the data is in place.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import msgspec
import numpy as np

from xferkit.driver import (
    AddressTable,
    BatchWorker,
    Capabilities,
    Descriptors,
    Driver,
    Manifest,
    Posted,
    QueuedBatch,
    Region,
)

from .copy import allow_writers, copy_local, explain, write_remote
from .faults import Faults

_LIVE: weakref.WeakValueDictionary[str, LoopbackDriver] = weakref.WeakValueDictionary()


class _Blob(msgspec.Struct, frozen=True):
    pid: int
    id: str
    regions: list[tuple[int, int]]  # registered [start, end) at the time of endpoint()


class _Link(NamedTuple):
    address: str
    pid: int
    socket: bytes
    registered: AddressTable  # the peer's memory when it handed out its endpoint


class _Job(QueuedBatch):
    __slots__ = ("fail", "link", "released", "stall")

    def __init__(self, link: _Link, descs: Descriptors | None, notify: bytes | None) -> None:
        super().__init__(descs, notify)
        self.link = link
        self.fail: str | None = None  # injected failure text
        self.stall = False
        self.released = threading.Event()

    def release(self) -> None:
        super().release()
        self.released.set()  # also ends a stall


def _socket_name(backend_id: str) -> bytes:
    return b"\0xferkit-loopback-" + backend_id.encode()


def _first_outside(table: AddressTable, addrs: np.ndarray, nbytes: np.ndarray) -> int:
    """Index of the first piece outside every registered range, or -1 (the NIC's own check)."""
    bad = np.flatnonzero(table.locate(addrs, nbytes) < 0)
    return int(bad[0]) if bad.size else -1


class LoopbackDriver(Driver):
    """Options: ``faults`` (a ``Faults`` to inject failures), ``max_batch`` (0: no limit)."""

    name: ClassVar[str] = "loopback"
    Blob: ClassVar[type[msgspec.Struct]] = _Blob

    def __init__(self, *, faults: Faults | None = None, max_batch: int = 0) -> None:
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}), notifications=True, cross_process=True, max_batch=max_batch
        )
        self.faults = faults if faults is not None else Faults()
        self.id = uuid.uuid4().hex[:16]
        self.address = f"{os.getpid()}:{self.id}"
        self._ranges: dict[int, int] = {}  # registered start -> end
        self._table: AddressTable | None = None  # rebuilt once per change, not per region
        self._counts = {"register": 0, "post": 0, "note": 0}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_socket_name(self.id))
        self._sock.setblocking(False)
        self._stalled: set[_Job] = set()
        self._worker: BatchWorker[_Job] = BatchWorker(
            self._execute, name=f"xferkit-loopback-{self.id}"
        )
        allow_writers()
        _LIVE[self.id] = self

    # -- registration: refuses what an RDMA engine refuses ----------------

    def register_regions(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        results: list[BaseException | None] = []
        with self._lock:
            for region in regions:
                start, end = region.addr, region.addr + region.nbytes
                self._counts["register"] += 1
                n = self._counts["register"]
                if n == self.faults.fail_register_at:
                    results.append(
                        RuntimeError(f"injected failure of registration #{n} [{start:#x}, {end:#x})")
                    )
                    break
                if start in self._ranges:
                    results.append(ValueError(f"[{start:#x}, {end:#x}) is already registered"))
                    break
                self._ranges[start] = end
                results.append(None)
            self._table = None
        return results

    def register_region(self, region: Region) -> None:
        (result,) = self.register_regions([region])
        if result is not None:
            raise result

    def deregister_region(self, region: Region) -> None:
        with self._lock:
            if self._ranges.get(region.addr) != region.addr + region.nbytes:
                raise ValueError(f"[{region.addr:#x}, +{region.nbytes}) is not registered")
            del self._ranges[region.addr]
            self._table = None

    def _registered(self) -> AddressTable:
        """What is registered now, as a lookup table."""
        with self._lock:
            if self._table is None:
                starts = np.fromiter(self._ranges, dtype=np.uint64, count=len(self._ranges))
                ends = np.fromiter(self._ranges.values(), dtype=np.uint64, count=len(self._ranges))
                self._table = AddressTable(starts, ends - starts)
            return self._table

    # -- peers ---------------------------------------------------------------

    def endpoint(self) -> _Blob:
        # Carries what is registered now: a peer in another process checks its writes
        # against it, like a NIC against remote keys.
        t = self._registered()
        ends = t.last + np.uint64(1)
        return _Blob(os.getpid(), self.id, list(zip(t.starts.tolist(), ends.tolist(), strict=True)))

    def connect(self, blob: Any, manifest: Manifest) -> Any:
        table = np.array(blob.regions, dtype=np.uint64).reshape(-1, 2)
        registered = AddressTable(table[:, 0], table[:, 1] - table[:, 0])
        return _Link(f"{blob.pid}:{blob.id}", blob.pid, _socket_name(blob.id), registered)

    # -- posting ---------------------------------------------------------------

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        return self._queue(_Job(link, descs, notify))

    def notify(self, link: Any, message: bytes) -> Posted:
        return self._queue(_Job(link, None, message))

    def _queue(self, job: _Job) -> _Job:
        with self._lock:
            self._counts["post"] += 1
            n = self._counts["post"]
        if n == self.faults.fail_post_at:
            job.fail = f"injected failure of post #{n}"
        if n == self.faults.stall_post_at:
            job.stall = True
            self._stalled.add(job)  # known at once, so close() aborts it even before it runs
        self._worker.post(job)
        return job

    def _execute(self, job: _Job) -> str | None:
        link, d = job.link, job.descs
        if job.stall:
            job.released.wait()
            self._stalled.discard(job)
            return "stalled post aborted"
        if f"loopback:{link.address}" in self.faults.dropped_peers:
            return f"peer loopback:{link.address} is unreachable (connection dropped)"
        if job.fail is not None:
            return job.fail
        if d is not None:
            error = self._copy(link, d)
            if error is not None:
                return error
        if job.notify is not None:
            with self._lock:
                self._counts["note"] += 1
                lost = self._counts["note"] == self.faults.lose_notification_at
            if not lost:
                try:
                    message = msgspec.msgpack.encode((self.address, job.notify))
                    self._sock.sendto(message, link.socket)
                except OSError as exc:
                    return f"data written, but the notification to {link.address} failed: {exc}"
        return None

    def _copy(self, link: _Link, d: Descriptors) -> str | None:
        local = _first_outside(self._registered(), d.src, d.nbytes)
        if local >= 0:
            return f"local address {int(d.src[local]):#x} is not registered"
        same_process = link.pid == os.getpid()
        if same_process:
            target = _LIVE.get(link.address.split(":", 1)[1])
            if target is None:
                return f"peer loopback:{link.address} is closed"
            registered = target._registered()
        else:
            registered = link.registered
        remote = _first_outside(registered, d.dst, d.nbytes)
        if remote >= 0:
            return (
                f"remote address {int(d.dst[remote]):#x} is not registered by "
                f"loopback:{link.address}"
            )
        if same_process:
            copy_local(d.src, d.dst, d.nbytes)
            return None
        err, index = write_remote(link.pid, d.src, d.dst, d.nbytes)
        return f"descriptor {index}: {explain(err, link.pid)}" if err else None

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except (BlockingIOError, OSError):
                return out
            try:
                out.append(msgspec.msgpack.decode(data, type=tuple[str, bytes]))
            except msgspec.DecodeError:
                continue  # anyone on this machine can send here: never let it cost good ones

    def close(self) -> None:
        for job in list(self._stalled):
            job.released.set()
        self._worker.stop()
        self._worker.join(timeout=10)
        self._sock.close()
        _LIVE.pop(self.id, None)
