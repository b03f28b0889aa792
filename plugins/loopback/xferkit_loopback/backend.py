"""The loopback driver: RDMA semantics (registration, async posts, notifications) on CPU memory.

It is deliberately strict, like a real engine: every batch is checked, when
it runs, against the memory registered on both ends and against the peer's
registration generation (a NIC's remote key: once the peer deregisters or
registers anew, writes through an old endpoint are refused). A peer process
is named by a pidfd taken at connect and its start time, so a reused PID is
never written. Copies run on one worker thread per peer (a stalled peer holds
no other back; the C helper releases the GIL); another process is written
with process_vm_writev; notifications travel as datagrams on an abstract unix
socket, sent only after the data, taken off it by whoever drains (an event
loop sleeping on ``notification_fd`` is woken by the datagram itself), and
moved into a bounded inbox by a thread when a sender finds the socket full
(``notices``). Both reach processes on one host only: a peer on another boot, pid
namespace or network namespace (``host``), or whose notification socket is not
there, is refused at connect, before anything is written.
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from xferkit.driver import (
    AddressTable,
    Capabilities,
    CapabilityError,
    Descriptors,
    Driver,
    DriverOptions,
    Manifest,
    Posted,
    Region,
    TransferError,
)

from .copy import allow_writers, copy_local, explain, start_time, write_remote
from .faults import Faults
from .host import this_host
from .link import Job, Link, LoopbackBlob
from .notices import Mailbox, socket_name, unreachable

_LIVE: weakref.WeakValueDictionary[str, LoopbackDriver] = weakref.WeakValueDictionary()


DESCRIPTOR_BYTES = 6000
"""A descriptor costs about 0.5-0.7 us at 8-9 GB/s across processes (process_vm_writev pins
each iovec's pages), where Sessions run: 5,400-6,400 bytes (benchmarks/bench_staging.py).
Within one process (memcpy) it costs 0.1 us, 1,024 bytes; declared at that, the
engine-shaped load's TP 2 -> 4 chunks went direct, one 512-byte descriptor per token row, at
0.86 GB/s quiet and 0.61 busy, against 1.01 and 0.88 staged (docs/performance.md)."""
COPY_COST = 2.0
"""Its large copies run at 2x the copier's strided pack (benchmarks/bench_staging.py)."""


class LoopbackOptions(DriverOptions, frozen=True):
    """What ``open_backend("loopback", ...)`` takes."""

    faults: Annotated[Faults | None, msgspec.Meta(description="failures to inject")] = None
    max_batch: Annotated[
        int, msgspec.Meta(ge=0, description="descriptors per post; 0: no limit")
    ] = 0


class LoopbackDriver(Driver):
    """Options: ``LoopbackOptions``."""

    name: ClassVar[str] = "loopback"
    Blob: ClassVar[type[msgspec.Struct]] = LoopbackBlob
    Options: ClassVar[type[DriverOptions]] = LoopbackOptions

    def __init__(self, options: LoopbackOptions | None = None) -> None:
        opts = options if options is not None else LoopbackOptions()
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}),
            notifications=True,
            cross_process=True,
            max_batch=opts.max_batch,
            descriptor_bytes=DESCRIPTOR_BYTES,
            copy_cost=COPY_COST,
        )
        self.faults = opts.faults if opts.faults is not None else Faults()
        self.id = uuid.uuid4().hex[:16]
        self.address = f"{os.getpid()}:{self.id}"
        self.host = this_host()
        self._ranges: dict[int, int] = {}  # registered start -> end
        self._table: AddressTable | None = None  # rebuilt once per change, not per region
        # The registration generation, where a peer process can read it (process_vm_readv).
        self._generation = np.zeros(1, dtype=np.uint64)
        self._counts = {"register": 0, "post": 0, "note": 0}
        self._lock = threading.Lock()
        self._mail = Mailbox(self.id)
        self._links: set[Link] = set()
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

    def endpoint(self) -> LoopbackBlob:
        # Carries what is registered now, and its generation: a peer checks its writes
        # against both, like a NIC against remote keys.
        t, generation = self._registered()
        ends = (t.last + np.uint64(1)).tolist()
        return LoopbackBlob(
            self.host,
            os.getpid(),
            self.id,
            start_time(os.getpid()),
            self._generation.ctypes.data,
            generation,
            list(zip(t.starts.tolist(), ends, strict=True)),
        )

    def connect(self, blob: Any, manifest: Manifest) -> Any:
        # Refused here, before any byte: a write would land and its notification would not.
        name = f"loopback:{blob.pid}:{blob.id}"
        differs = self.host.differs(blob.host)
        if differs:
            raise CapabilityError(
                f"the loopback reaches processes on one host only: peer {name} is on "
                f"another host ({'; '.join(differs)})",
                subject=name,
            )
        why = unreachable(socket_name(blob.id))
        if why is not None:
            raise TransferError(
                f"peer {name}: its notification socket is unreachable from here ({why}); "
                "nothing was written",
                subject=name,
            )
        link = Link(blob, self._execute, name=f"xferkit-loopback-{self.id}-{blob.id}")
        self._links.add(link)
        return link

    def disconnect(self, link: Any) -> None:
        self._links.discard(link)
        link.close()

    # -- posting ---------------------------------------------------------------

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        return self._queue(link, descs, notify)

    def notify(self, link: Any, message: bytes) -> Posted:
        return self._queue(link, None, message)

    def _queue(self, link: Link, descs: Descriptors | None, notify: bytes | None) -> Job:
        with self._lock:
            self._counts["post"] += 1
            n = self._counts["post"]
        fail = f"injected failure of post #{n}" if n == self.faults.fail_post_at else None
        job = Job(link, descs, notify, fail, stall=n == self.faults.stall_post_at)
        link.worker.post(job)
        return job

    def _execute(self, job: Job) -> str | None:
        link, d = job.link, job.descs
        if job.released is not None:  # an injected stall
            job.released.wait()
            return "stalled post aborted"
        if link.name in self.faults.dropped_peers:
            return f"peer {link.name} is unreachable (connection dropped)"
        if job.fail is not None:
            return job.fail
        if d is not None:
            error = self._copy(link, d)
            if error is not None:
                return error
        if job.notify is not None:
            with self._lock:
                self._counts["note"] += 1
                n = self._counts["note"]
            if n != self.faults.lose_notification_at:
                return self._mail.send(
                    self.address, job.notify, link.address, link.socket, link.pokes
                )
        return None

    def _copy(self, link: Link, d: Descriptors) -> str | None:
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

    def _stale(self, link: Link) -> str | None:
        """Why the peer's memory is no longer what its endpoint offered, or None."""
        name = link.name
        if link.generation_word is None:  # in this process
            target = _LIVE.get(link.blob.id)
            if target is None:
                return f"peer {name} is closed"
            generation = int(target._generation[0])
        else:
            if link.exited.poll(0):  # readable pidfd: the process exited
                return f"peer {name}: process {link.blob.pid} has exited"
            err, generation = link.generation_word.read()
            if err:
                return f"peer {name}: reading its registration state: {explain(err, link.blob.pid)}"
        if generation != link.blob.generation:
            return (
                f"peer {name} deregistered or re-registered its memory since it handed out "
                "this endpoint (stale remote key): connect again with its new endpoint"
            )
        return None

    def notification_fd(self) -> int | None:
        return self._mail.fd

    def notifications(self) -> list[tuple[str, bytes]]:
        return self._mail.drain()

    def close(self) -> None:
        self._mail.closing.set()
        for link in list(self._links):  # the core disconnected them all, unless it was dropped
            link.close()
        self._mail.close()
        _LIVE.pop(self.id, None)
