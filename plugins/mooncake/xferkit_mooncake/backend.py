"""The Mooncake driver: xferkit's driver primitives over one Mooncake TransferEngine.

Each driver owns a private engine (its own segment ``host:port``), so what it
registers never meets another driver's memory inside Mooncake. The core has
already refused empty regions, unchecked descriptors, malformed endpoints and
calls after ``close``; this module only speaks Mooncake.

A registration after an endpoint was handed out starts a new engine: peers
holding the old endpoint reach the old segment, which holds no memory any more
and refuses their writes itself (Mooncake checks every write against what the
receiving engine registered, as a NIC checks a remote key). The old engines
stay up, empty, until ``close``, so that no later engine can take their ports.

A fence (``fence``, over TCP) registers the memory in a new engine and destroys
the old one, which closes its listeners and every connection peers made to it:
a peer cut off is refused from then on (later engines of this driver never take
those ports). Unregistering alone is no fence: Mooncake checks
a write's destination once, when its header arrives, and reads the body
straight into memory, so writes already checked go on landing (14-192 MB of 256
MB measured), and a sender whose queued slices are refused hangs in its next
batch. The check names no sender, so a fence cuts every peer at once
(``Capabilities.fence_cuts_all``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import msgspec
import numpy as np

from xferkit.driver import (
    Advertised,
    Capabilities,
    Descriptors,
    Driver,
    DriverOptions,
    Manifest,
    PluginError,
    Posted,
    ProtocolError,
    QueuedBatch,
    Region,
    RegistrationError,
    rdma_devices,
)

from . import engine as _engine
from .codes import check, code_name, explain
from .lane import Lane, Local, decode_messages
from .memory import Holdings, Runs

log = logging.getLogger("xferkit.mooncake")

MAX_BATCH = 1024
"""Entries per engine call. Mooncake's TCP transport queues at most 1024 transfers per peer
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); a batch over the limit fails and can leave that
peer failing for the engine's lifetime. One batch in flight per peer keeps us under it."""

LANE_JOIN_S = 5.0

LANE_NICE = 5
"""A lane spins in the engine's synchronous call for as long as its batch is in flight. Under
an engine-shaped load on 2 cores (8 lanes, 2 prefill ranks) the spin was a fifth of the CPU.
At nice 5 that load moved about a fifth more, quiet or with the cores kept busy; at 10 the
busy rows lost, the lanes then noticing their batches' ends late (docs/mooncake.md)."""


DESCRIPTOR_BYTES = 60_000
"""About 28 us per descriptor at 2.1 GB/s over TCP (benchmarks/bench_staging.py); RDMA is
unmeasured here."""
COPY_COST = 0.33
"""TCP moves large copies at a third of the copier's strided pack (benchmarks/bench_staging.py)."""


class _Blob(msgspec.Struct, frozen=True):
    """Decoded by the core with these constraints: a malformed one never reaches ``connect``."""

    segment: Annotated[str, msgspec.Meta(pattern=r"^\S+:[0-9]{1,5}$", max_length=300)]  # host:port
    protocol: str
    anchor: Annotated[int, msgspec.Meta(ge=0)]  # the target of a notification sent alone


class _Link(NamedTuple):
    anchor: int  # the peer's, from its endpoint
    lane: Lane


class MooncakeOptions(DriverOptions, frozen=True):
    """What ``open_backend("mooncake", ...)`` takes."""

    protocol: Annotated[
        Literal["rdma", "tcp"] | None,
        msgspec.Meta(description="rdma or tcp; None: rdma where an RDMA device exists"),
    ] = None
    device: Annotated[
        str, msgspec.Meta(description="RDMA device names, comma-separated; empty: all")
    ] = ""
    hostname: Annotated[
        str, msgspec.Meta(min_length=1, description="the address peers reach this engine at")
    ] = "127.0.0.1"
    notifications: Annotated[bool, msgspec.Meta(description="deliver notifications")] = True
    max_batch: Annotated[
        int, msgspec.Meta(ge=1, le=MAX_BATCH, description="entries per engine call")
    ] = MAX_BATCH
    stall_timeout: (
        Annotated[
            int,
            msgspec.Meta(
                ge=1,
                le=3600,
                description="seconds without progress before the TCP transport drops a "
                "transfer; None: MC_TCP_PROGRESS_TIMEOUT_SEC as exported, else 5 (process-wide, "
                "see engine.configure)",
            ),
        ]
        | None
    ) = None
    lane_nice: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=19,
            description="how much each peer's lane thread raises its nice value: the engine's "
            "synchronous batch call busy-waits on it while a batch is in flight (0: leave it)",
        ),
    ] = LANE_NICE


class MooncakeDriver(Driver):
    """Options: ``MooncakeOptions``."""

    name: ClassVar[str] = "mooncake"
    Blob: ClassVar[type[msgspec.Struct]] = _Blob
    Options: ClassVar[type[DriverOptions]] = MooncakeOptions

    def __init__(self, options: MooncakeOptions | None = None) -> None:
        opts = options if options is not None else MooncakeOptions()
        stall = (
            _engine.default_stall_timeout() if opts.stall_timeout is None else opts.stall_timeout
        )
        self.protocol = _engine.pick_protocol(opts.protocol, rdma_devices())
        # Over TCP the fence is shown by tests; over RDMA deregistering should invalidate the
        # keys peers hold, but no RDMA device has been here to show it: not declared.
        fencing = self.protocol == "tcp"
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}),
            notifications=opts.notifications,
            cross_process=True,
            max_batch=opts.max_batch,
            descriptor_bytes=DESCRIPTOR_BYTES,
            copy_cost=COPY_COST,
            fencing=fencing,
            fence_cuts_all=fencing,
        )
        self.stall_timeout = stall
        self._start = (opts.hostname, self.protocol, opts.device)
        self._lane_nice = opts.lane_nice
        _engine.configure(stall)
        engine, self.address, self._data_port = _engine.start(*self._start)
        self._local = Local(engine, self.address)  # shared with every lane
        self._retired: list[tuple[Any, str]] = []  # (engine, segment) gone stale; kept to close
        self._fenced_ports: set[int] = (
            set()
        )  # of engines a fence destroyed: none of ours reuses them
        self._published = False  # an endpoint of the current engine was handed out
        self._holdings = Holdings()
        self._lanes: list[Lane] = []  # every lane not yet seen finished; joined on close
        log.debug("mooncake: engine started, segment %s", self.address)

    def __repr__(self) -> str:
        return f"MooncakeDriver({self.address!r}, {self.protocol})"

    def advertised_host(self) -> Advertised:
        # The segment peers are told (host:port) is this host name: 127.0.0.1 unless set.
        return Advertised(self._start[0], "hostname")

    @property
    def engine(self) -> Any:
        """The current TransferEngine (settable: a test or benchmark may wrap it)."""
        engine = self._local.engine
        assert engine is not None, "the core calls nothing after close()"
        return engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self._local.engine = engine

    # -- memory ----------------------------------------------------------------

    def register_regions(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        if self._published:
            self._renew()
        if not regions:
            return []
        runs = Runs(regions)
        rc = self.engine.batch_register_memory(runs.starts, runs.lengths)
        if rc == 0:
            self._holdings.add(runs, regions)
            return [None] * len(regions)
        # One code for the whole batch. Mooncake checks every entry for zero length and
        # overlap before registering any, so after -1 or -7 nothing is held; a later failure
        # (inside a transport) may have left some registered, so those are released first.
        # Then registering one by one names the culprit; the core rolls back the ones before.
        if rc not in (-1, -7):
            for start in runs.starts:
                self.engine.unregister_memory(start)  # -3 when it was not held: fine
        results = list(super().register_regions(regions))
        if results[-1] is None:
            log.warning(
                "mooncake: batch_register_memory returned %s, but every region registered alone",
                explain(rc, registering=True),
            )
            return results
        alone = results[-1]
        results[-1] = RegistrationError(
            f"Mooncake batch_register_memory of {len(regions)} regions returned {code_name(rc)}; "
            f"registered one by one, entry #{len(results)}: {alone}"
        )
        results[-1].__cause__ = alone
        return results

    def register_region(self, region: Region) -> None:
        rc = self.engine.register_memory(region.addr, region.nbytes)
        check(rc, f"register_memory [{region.addr:#x}, +{region.nbytes})", registering=True)
        self._holdings.add_one(region)

    def deregister_region(self, region: Region) -> None:
        start = self._holdings.remove(region)
        if start is not None:  # the last region of that engine buffer
            check(self.engine.unregister_memory(start), f"unregister_memory {start:#x}")

    def _renew(self) -> None:
        """Retire the engine whose endpoint peers may hold: its segment refuses them from now."""
        old = (self.engine, self.address)
        for start in self._holdings.starts():  # left over by a failed deregistration
            old[0].unregister_memory(start)
        self._holdings.clear()
        engine, self.address, self._data_port = _engine.start(
            *self._start, avoid=frozenset(self._fenced_ports)
        )
        self._retired.append(old)
        self._local.engine, self._local.segment = engine, self.address
        self._published = False
        log.info("mooncake: registering again as segment %s (retired %s)", self.address, old[1])

    def fence(self, source: str) -> None:
        """Cut every peer off (``source`` among them): the memory moves to a new engine and the
        old one is destroyed (see the module)."""
        started = _engine.start(*self._start, avoid=frozenset(self._fenced_ports))
        starts, lengths = self._holdings.starts(), self._holdings.lengths()
        rc = started[0].batch_register_memory(starts, lengths) if starts else 0
        if rc != 0:
            _engine.stop(*started[:2])
            check(rc, f"registering {len(starts)} buffers again in a new engine to fence {source}")
        old, segment, port = self.engine, self.address, self._data_port
        self._local.engine, self._local.segment = started[0], started[1]
        self.address, self._data_port = started[1], started[2]
        self._published = False
        # A batch of ours already inside the old engine holds it (Lane); it ends within the
        # transport's stall timeout, and the engine must outlive it.
        limit = time.monotonic() + self.stall_timeout + LANE_JOIN_S
        while sys.getrefcount(old) > 2 and time.monotonic() < limit:  # ``old`` and the call's
            time.sleep(0.005)
        if sys.getrefcount(old) > 2:
            self._retired.append((old, segment))
            raise PluginError(
                f"mooncake: fencing {source}: a batch of this driver still runs in the engine "
                f"of segment {segment} after {self.stall_timeout + LANE_JOIN_S:.0f} s: not fenced"
            )
        _engine.stop(old, segment)
        del old  # the last reference: its listeners and every connection peers made close now
        self._fenced_ports |= {int(segment.rsplit(":", 1)[1]), port or 0}
        log.info("mooncake: fenced %s: segment %s retired, %s from now", source, segment,
                 self.address)  # fmt: skip

    # -- peers -----------------------------------------------------------------

    def endpoint(self) -> _Blob:
        self._published = True
        return _Blob(self.address, self.protocol, self._holdings.anchor())

    def connect(self, blob: Any, manifest: Manifest) -> _Link:
        if blob.protocol != self.protocol:
            raise ProtocolError(
                f"mooncake: peer {blob.segment} speaks {blob.protocol}, this driver "
                f"{self.protocol}; open both with the same protocol option"
            )
        if not 0 < int(blob.segment.rsplit(":", 1)[1]) < 65536 or blob.anchor >= 2**64:
            raise ProtocolError(
                f"mooncake: endpoint of {blob.segment!r}: no TCP port, or an anchor beyond 64 bits"
            )
        lane = Lane(self._local, blob.segment, self._lane_nice)
        self._lanes = [old for old in self._lanes if old.alive] + [lane]
        return _Link(blob.anchor, lane)

    def disconnect(self, link: _Link) -> None:
        link.lane.stop()  # the core ended this link's transfers; the thread drains its queue

    # -- transfers -------------------------------------------------------------

    def post(self, link: _Link, descs: Descriptors, notify: bytes | None) -> Posted:
        job = QueuedBatch(descs, notify)
        link.lane.post(job)
        return job

    def notify(self, link: _Link, message: bytes) -> Posted:
        # The engine refuses an empty batch (-1) and reads entries[0] for the notification's
        # target: one zero-length entry between registered addresses moves nothing but carries it.
        entry = Descriptors(
            np.array([self._holdings.anchor()], np.uint64),
            np.array([link.anchor], np.uint64),
            np.zeros(1, np.uint64),
        )
        return self.post(link, entry, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        # Retired engines too: a notification sent alone moves no byte, so a peer holding an
        # old endpoint may still deliver one there.
        return [
            (n.name, message)
            for engine, _ in (*self._retired, (self.engine, self.address))
            for n in engine.get_notifies()
            for message in decode_messages(n.msg)
        ]

    def close(self) -> None:
        for lane in self._lanes:
            lane.stop()  # the core disconnected every peer already; stopping twice is harmless
        stuck = [lane.segment for lane in self._lanes if not lane.join(LANE_JOIN_S)]
        if stuck:
            # Their threads hold the engine in use until their batches end.
            log.warning("mooncake: closing with batches still running towards %s", stuck)
        else:
            for engine, segment in (*self._retired, (self.engine, self.address)):
                _engine.stop(engine, segment)
        self._retired.clear()
        self._lanes.clear()
        self._local.engine = None  # the last references: the engines are destroyed here
