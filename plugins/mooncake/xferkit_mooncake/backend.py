"""The Mooncake backend: registration, peers, posting and notifications over one TransferEngine.

Each backend owns a private engine (its own segment ``host:port``), so what it
registers never meets another backend's memory inside Mooncake. The core has
already filtered empty regions and bounds-checked every descriptor; this
module only speaks Mooncake.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from xferkit import (
    Backend,
    Capabilities,
    CapabilityError,
    Descriptors,
    Manifest,
    Notification,
    Posted,
    ProtocolError,
    Region,
    XferError,
)

from . import engine as _engine
from .codes import code_name, explain
from .lane import Job, Lane, decode_message

log = logging.getLogger("xferkit.mooncake")

MAX_BATCH = 1024
"""Entries per engine call. Mooncake's TCP transport queues at most 1024 transfers per peer
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); a batch over the limit fails and can leave that
peer failing for the engine's lifetime. One batch in flight per peer keeps us under it."""

LANE_JOIN_S = 5.0


class _Blob(msgspec.Struct, frozen=True):
    segment: str  # host:rpc_port
    protocol: str


class _PeerHandle(NamedTuple):
    name: str
    segment: str
    anchor: int  # an address the peer registered: the target of a zero-length entry


class MooncakeBackend(Backend):
    """Options: ``protocol`` ("rdma" or "tcp"; default rdma where an RDMA device exists),
    ``device`` (RDMA device names, comma-separated; empty = all), ``hostname`` (the address
    peers reach this engine at), ``notifications`` (deliver them; default on) and
    ``max_batch`` (entries per engine call, at most 1024)."""

    name = "mooncake"

    def __init__(
        self,
        *,
        protocol: str | None = None,
        device: str = "",
        hostname: str = "127.0.0.1",
        notifications: bool = True,
        max_batch: int = MAX_BATCH,
    ) -> None:
        super().__init__()
        if not 1 <= max_batch <= MAX_BATCH:
            raise CapabilityError(f"mooncake: max_batch must be within 1..{MAX_BATCH}")
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}),
            notifications=notifications,
            cross_process=True,
            max_batch=max_batch,
        )
        self.protocol = _engine.pick_protocol(protocol)
        self._engine, self.segment = _engine.start(hostname, self.protocol, device)
        self.peer_name = f"mooncake:{self.segment}"
        self._registered: dict[int, int] = {}  # addr -> nbytes, what this backend holds
        self._lanes: dict[str, Lane] = {}  # by peer segment
        self._retired: list[Lane] = []  # stopped on disconnect, joined on close
        self._lock = threading.Lock()
        log.debug("mooncake: engine started, segment %s", self.segment)

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.segment!r}, {self.protocol})"

    # -- registration --------------------------------------------------------

    def _register_batch(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        if not regions:
            return []
        addrs, sizes = [r.addr for r in regions], [r.nbytes for r in regions]
        rc = self._engine.batch_register_memory(addrs, sizes)
        if rc == 0:
            self._registered.update(zip(addrs, sizes, strict=True))
            return [None] * len(regions)
        # One code for the whole batch. Mooncake checks every entry for zero length
        # and overlap before registering any, so after -1 or -7 nothing is held; a
        # later failure (inside a transport) may have left some entries registered,
        # so those are released first. Then registering one by one names the culprit,
        # and the core rolls back the ones before it.
        if rc not in (-1, -7):
            for addr in addrs:
                if addr not in self._registered:
                    self._engine.unregister_memory(addr)  # -3 when it was not held: fine
        results: list[BaseException | None] = []
        for i, (addr, size) in enumerate(zip(addrs, sizes, strict=True)):
            alone = self._engine.register_memory(addr, size)
            if alone != 0:
                results.append(
                    RuntimeError(
                        f"Mooncake batch_register_memory of {len(regions)} regions returned "
                        f"{code_name(rc)}; registered one by one, entry "
                        f"#{i + 1} [{addr:#x}, +{size}) returned "
                        f"{explain(alone, registering=True)}"
                    )
                )
                return results
            self._registered[addr] = size
            results.append(None)
        log.warning(
            "mooncake: batch_register_memory returned %s, but every region registered alone",
            explain(rc, registering=True),
        )
        return results

    def _register_region(self, region: Region) -> None:
        rc = self._engine.register_memory(region.addr, region.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {explain(rc, registering=True)}")
        self._registered[region.addr] = region.nbytes

    def _deregister_region(self, region: Region) -> None:
        rc = self._engine.unregister_memory(region.addr)
        self._registered.pop(region.addr, None)
        if rc != 0:
            raise RuntimeError(f"Mooncake unregister_memory returned {explain(rc)}")

    # -- peers ---------------------------------------------------------------

    def _endpoint(self) -> bytes:
        return msgspec.msgpack.encode(_Blob(self.segment, self.protocol))

    def _connect(self, blob: bytes, manifest: Manifest) -> tuple[str, Any]:
        try:
            b = msgspec.msgpack.decode(blob, type=_Blob)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"mooncake: malformed endpoint: {exc}") from exc
        if b.protocol != self.protocol:
            raise ProtocolError(
                f"mooncake: peer {b.segment} speaks {b.protocol}, this backend {self.protocol}; "
                f"open both with the same protocol option"
            )
        anchor = manifest.regions[0].addr if manifest.regions else 0
        handle = _PeerHandle(f"mooncake:{b.segment}", b.segment, anchor)
        with self._lock:
            lane = self._lanes.get(b.segment)
            if lane is None:
                lane = self._lanes[b.segment] = Lane(self._engine, b.segment, self.peer_name)
            lane.users += 1
        return handle.name, handle

    def _disconnect(self, handle: _PeerHandle) -> None:
        with self._lock:
            lane = self._lanes.get(handle.segment)
            if lane is None:
                return
            lane.users -= 1
            if lane.users == 0:
                del self._lanes[handle.segment]
                lane.stop()  # batches already queued still run
                self._retired = [old for old in self._retired if old.running] + [lane]

    # -- posting ---------------------------------------------------------------

    def _post(self, handle: _PeerHandle, descs: Descriptors, notify: bytes | None) -> Posted:
        lane = self._lanes.get(handle.segment)
        if lane is None:
            raise XferError(f"mooncake: peer {handle.name} is disconnected")
        local = self._manifest.regions[0].addr if self._manifest and self._manifest.regions else 0
        job = Job(descs, notify, (local, handle.anchor))
        lane.post(job)
        return job

    def _notifications(self) -> list[Notification]:
        self._check_open()  # the engine is gone after close()
        return [Notification(n.name, decode_message(n.msg)) for n in self._engine.get_notifies()]

    def _close(self) -> None:
        with self._lock:
            active, self._lanes = list(self._lanes.values()), {}
            lanes, self._retired = active + self._retired, []
        for lane in active:
            lane.stop()
        stuck = [lane.segment for lane in lanes if not lane.join(LANE_JOIN_S)]
        if stuck:
            # Their threads keep the engine alive until their batches end.
            log.warning("mooncake: closing with batches still running towards %s", stuck)
        else:
            _engine.stop(self._engine, self.segment)
        self._engine = None  # the last reference: the engine is destroyed here
