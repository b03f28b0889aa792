"""The loopback driver: RDMA semantics (registration, async posts, notifications) on CPU memory.

It is deliberately strict, like a real engine: every batch is checked, when
it runs, against the memory registered on both ends and against the peer's
registration generation (a NIC's remote key: once the peer deregisters or
registers anew, writes through an old endpoint are refused). A peer process
is named by a pidfd taken at connect and its start time, so a reused PID is
never written. Copies run on one worker thread per peer (a stalled peer holds
no other back; the C helper releases the GIL); another process is written
with process_vm_writev; notifications travel as datagrams on an abstract unix
socket, sent only after the data, and are queued on arrival by a receiver
thread, up to a bound.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from xferkit import Descriptors, Manifest, Region
from xferkit.driver import AddressTable, BatchWorker, Capabilities, Driver, Posted, QueuedBatch

from .copy import allow_writers, copy_local, explain, read_remote, start_time, write_remote
from .faults import Faults

_LIVE: weakref.WeakValueDictionary[str, LoopbackDriver] = weakref.WeakValueDictionary()

MAX_QUEUED = 1 << 16
"""Notifications a receiver holds undrained; past it senders wait, then fail saying so."""
NOTIFY_WAIT_S = 10.0
"""How long a sender waits for room in a full receiver before its write fails."""


class _Blob(msgspec.Struct, frozen=True):
    pid: int
    id: str
    started: int  # the process's start time (clock ticks since boot): pid + this is unique
    generation_addr: int  # where the peer keeps its registration generation
    generation: int  # the generation these regions belong to
    regions: list[tuple[int, int]]  # registered [start, end) at the time of endpoint()


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


class _Link:
    """One connected peer: what its endpoint said, a pidfd naming its process, its worker."""

    def __init__(self, driver: LoopbackDriver, blob: _Blob) -> None:
        self.address = f"{blob.pid}:{blob.id}"
        self.blob = blob
        self.socket = _socket_name(blob.id)
        table = np.array(blob.regions, dtype=np.uint64).reshape(-1, 2)
        self.registered = AddressTable(table[:, 0], table[:, 1] - table[:, 0])
        self.local = blob.pid == os.getpid()
        self.pidfd = -1 if self.local else _open_process(blob.pid, blob.started)
        self.worker: BatchWorker[_Job] = BatchWorker(
            driver._execute, name=f"xferkit-loopback-{driver.id}-{blob.id}"
        )

    def close(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=10)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _socket_name(backend_id: str) -> bytes:
    return b"\0xferkit-loopback-" + backend_id.encode()


def _open_process(pid: int, started: int) -> int:
    """A pidfd for ``pid``, checked to be the process that made the endpoint."""
    fd = os.pidfd_open(pid)
    if start_time(pid) != started:
        os.close(fd)
        raise ProcessLookupError(f"pid {pid} now names another process: the peer is gone")
    return fd


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
        # The registration generation, where a peer process can read it (process_vm_readv).
        self._generation = np.zeros(1, dtype=np.uint64)
        self._counts = {"register": 0, "post": 0, "note": 0}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_socket_name(self.id))
        self._sock.settimeout(0.05)  # the receiver wakes to notice close()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._links: set[_Link] = set()
        self._closing = threading.Event()
        self._receiver = threading.Thread(
            target=_receive,
            args=(weakref.ref(self), self._sock, self._inbox, self._closing),
            name=f"xferkit-loopback-{self.id}-rx",
            daemon=True,
        )
        self._receiver.start()
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
                    why = f"injected failure of registration #{n} [{start:#x}, {end:#x})"
                    results.append(RuntimeError(why))
                    break
                if start in self._ranges:
                    results.append(ValueError(f"[{start:#x}, {end:#x}) is already registered"))
                    break
                self._ranges[start] = end
                results.append(None)
            self._changed()
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
            self._changed()

    def _changed(self) -> None:
        """Registered memory changed: endpoints handed out so far are stale (new remote keys)."""
        self._table = None
        self._generation[0] += 1

    def _registered(self) -> tuple[AddressTable, int]:
        """What is registered now, as a lookup table, and its generation."""
        with self._lock:
            if self._table is None:
                starts = np.fromiter(self._ranges, dtype=np.uint64, count=len(self._ranges))
                ends = np.fromiter(self._ranges.values(), dtype=np.uint64, count=len(self._ranges))
                self._table = AddressTable(starts, ends - starts)
            return self._table, int(self._generation[0])

    # -- peers ---------------------------------------------------------------

    def endpoint(self) -> _Blob:
        # Carries what is registered now, and its generation: a peer checks its writes
        # against both, like a NIC against remote keys.
        t, generation = self._registered()
        ends = (t.last + np.uint64(1)).tolist()
        return _Blob(
            os.getpid(),
            self.id,
            start_time(os.getpid()),
            self._generation.ctypes.data,
            generation,
            list(zip(t.starts.tolist(), ends, strict=True)),
        )

    def connect(self, blob: Any, manifest: Manifest) -> Any:
        link = _Link(self, blob)
        self._links.add(link)
        return link

    def disconnect(self, link: Any) -> None:
        self._links.discard(link)
        link.close()

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
        job.stall = n == self.faults.stall_post_at
        job.link.worker.post(job)
        return job

    def _execute(self, job: _Job) -> str | None:
        link, d = job.link, job.descs
        if job.stall:
            job.released.wait()
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
                return self._send(link, job.notify)
        return None

    def _copy(self, link: _Link, d: Descriptors) -> str | None:
        table, _ = self._registered()
        local = table.first_outside(d.src, d.nbytes)
        if local >= 0:
            return f"local address {int(d.src[local]):#x} is not registered"
        stale = self._stale(link)
        if stale is not None:
            return stale
        remote = link.registered.first_outside(d.dst, d.nbytes)
        if remote >= 0:
            return (
                f"remote address {int(d.dst[remote]):#x} is not registered by "
                f"loopback:{link.address}"
            )
        if link.local:
            copy_local(d.src, d.dst, d.nbytes)
            return None
        err, index = write_remote(link.blob.pid, d.src, d.dst, d.nbytes)
        return f"descriptor {index}: {explain(err, link.blob.pid)}" if err else None

    def _stale(self, link: _Link) -> str | None:
        """Why the peer's memory is no longer what its endpoint offered, or None."""
        name = f"loopback:{link.address}"
        if link.local:
            target = _LIVE.get(link.blob.id)
            if target is None:
                return f"peer {name} is closed"
            generation = int(target._generation[0])
        else:
            if select.select([link.pidfd], [], [], 0)[0]:  # readable: the process exited
                return f"peer {name}: process {link.blob.pid} has exited"
            err, generation = read_remote(link.blob.pid, link.blob.generation_addr)
            if err:
                return f"peer {name}: reading its registration state: {explain(err, link.blob.pid)}"
        if generation != link.blob.generation:
            return (
                f"peer {name} deregistered or re-registered its memory since it handed out "
                "this endpoint (stale remote key): connect again with its new endpoint"
            )
        return None

    def _send(self, link: _Link, message: bytes) -> str | None:
        """Send after the data; a full receiver makes us wait (bounded), never drop."""
        data = msgspec.msgpack.encode((self.address, message))
        deadline = time.monotonic() + NOTIFY_WAIT_S
        while not self._closing.is_set():
            try:
                self._sock.sendto(data, link.socket)  # blocks up to the socket timeout
                return None
            except TimeoutError:
                if time.monotonic() > deadline:
                    return (
                        f"data written, but peer loopback:{link.address} holds {MAX_QUEUED} "
                        f"undrained notifications and took none for {NOTIFY_WAIT_S} s"
                    )
            except OSError as exc:
                return f"data written, but the notification to {link.address} failed: {exc}"
        return "data written, but the backend closed before the notification went out"

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def close(self) -> None:
        self._closing.set()
        for link in list(self._links):  # the core disconnected them all, unless it was dropped
            link.close()
        self._receiver.join(timeout=10)
        self._sock.close()
        _LIVE.pop(self.id, None)


def _receive(
    owner: weakref.ref[LoopbackDriver],
    sock: socket.socket,
    inbox: deque[tuple[str, bytes]],
    closing: threading.Event,
) -> None:
    """Move arriving notifications into the inbox; stop taking them while it is full."""
    while not closing.is_set() and owner() is not None:
        if len(inbox) >= MAX_QUEUED:
            closing.wait(0.01)  # the kernel queue fills next; senders wait, then fail
            continue
        try:
            data = sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:
            return
        try:
            inbox.append(msgspec.msgpack.decode(data, type=tuple[str, bytes]))
        except msgspec.DecodeError:
            continue  # anyone on this machine can send here: never let it cost good ones
