"""What a transfer driver must do, and the guards the core runs before a driver sees anything.

A driver subclasses ``Backend`` and implements the underscored primitives
(register one region, post one batch, ...). The public methods are the core's:
they refuse unsupported requests up front, keep registration all-or-nothing,
bounds-check every descriptor against local and advertised memory, split
batches to the driver's limit and report the first real error. A driver never
receives a zero-length region or descriptor.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from .errors import (
    BoundsError,
    CapabilityError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from .manifest import Manifest, Region
from .planner import Descriptors

log = logging.getLogger("xferkit")

CONTRACT_VERSION = 1
"""Bumped whenever the driver primitives change; plugins declare the one they implement."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a driver declares it can do; the core checks requests against it."""

    memory: frozenset[str] = frozenset({"cpu"})  # device kinds: "cpu", "cuda"
    notifications: bool = False
    cross_process: bool = False
    max_batch: int = 0  # most descriptors per post; 0 = no limit
    min_transfer: int = 1  # smallest descriptor, in bytes


class Status(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Notification(msgspec.Struct, frozen=True):
    """A message a peer attached to a write, delivered after that write's data."""

    peer: str
    message: bytes


class Endpoint(msgspec.Struct, frozen=True):
    """The core's envelope around a driver's endpoint blob: which driver, which process."""

    backend: str
    contract: int
    host: str
    pid: int
    blob: bytes


class Posted(ABC):
    """A driver's handle on one posted batch."""

    @abstractmethod
    def poll(self) -> Status:
        """Progress check; must never block."""

    @property
    @abstractmethod
    def error(self) -> str:
        """The driver's own text for a FAILED batch."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free driver resources (called once, after completion or on abort)."""

    def block(self, timeout: float) -> None:
        """Sleep until the batch may have progressed, at most ``timeout`` seconds.

        Drivers that can block on completion override this; the default naps.
        """
        time.sleep(min(timeout, 5e-5))


class Peer:
    """A connected remote backend and the memory it advertised."""

    __slots__ = ("_ends", "_order", "_starts", "endpoint", "handle", "manifest", "name")

    def __init__(self, name: str, endpoint: Endpoint, manifest: Manifest, handle: Any) -> None:
        self.name = name
        self.endpoint = endpoint
        self.manifest = manifest
        self.handle = handle
        self._starts, self._ends, self._order = _region_table(manifest)

    def __repr__(self) -> str:
        return f"Peer({self.name!r}, {len(self.manifest)} regions)"


def _region_table(m: Manifest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.argsort(m.addrs, kind="stable")
    starts = m.addrs[order]
    return starts, starts + m.nbytes[order], order


def _inside(addrs: np.ndarray, nbytes: np.ndarray, starts, ends) -> np.ndarray:
    """Mask of pieces lying inside one region of the table (vectorized)."""
    if not starts.size:
        return np.zeros(addrs.size, dtype=bool)
    where = np.searchsorted(starts, addrs, side="right") - 1  # -1: below every region
    ends_at = addrs + nbytes
    # ends[-1] for where == -1 is harmless: that piece is already marked outside.
    inside = (where >= 0) & (ends_at >= addrs)  # the second catches uint64 wrap-around
    inside &= ends_at <= ends[where]
    return inside


class Transfer:
    """An asynchronous write: ``poll`` never blocks, ``wait`` does, ``error`` says why it failed.

    Large descriptor sets go out in several driver batches; the notification
    rides on the last batch, posted only once every other batch is done, so
    the peer never sees it before the data. That last batch is posted by
    ``poll`` (or ``wait``): a split write progresses while its sender polls it,
    as an engine does anyway to learn when the source memory is free again.
    """

    def __init__(
        self,
        backend: Backend,
        peer: Peer,
        descs: Descriptors,
        batches: list[Descriptors],
        notify: bytes | None,
    ) -> None:
        self.peer = peer
        self.descs = descs
        self.error: TransferError | None = None
        self._backend = backend
        self._waiting = batches  # not yet posted
        self._notify = notify
        self._posted: list[Posted] = []
        self._status = Status.PENDING
        self._advance()

    def _post_next(self, batch: Descriptors, notify: bytes | None) -> None:
        try:
            self._posted.append(self._backend._post(self.peer.handle, batch, notify))
        except Exception as exc:  # the driver refused the post itself
            refusal = f"posting {len(batch)} descriptors failed: {exc}"
            earlier = next((p for p in self._posted if p.poll() is Status.FAILED), None)
            if earlier is None:
                self._fail(refusal, exc)
            else:  # an earlier batch failed first: the refusal is its consequence
                self._fail(earlier.error, later=TransferError(refusal, subject=self.peer.name))

    def _advance(self) -> None:
        if self._status is not Status.PENDING:
            return
        # All but the last batch go out at once; the last (with the notification) waits.
        while len(self._waiting) > 1:
            self._post_next(self._waiting.pop(0), None)
            if self._status is Status.FAILED:
                return
        states = [p.poll() for p in self._posted]
        for p, st in zip(self._posted, states, strict=True):
            if st is Status.FAILED:
                self._fail(p.error)
                return
        if all(st is Status.DONE for st in states):
            if self._waiting:
                self._post_next(self._waiting.pop(), self._notify)
                if self._status is Status.PENDING:
                    self._advance()
                return
            self._finish(Status.DONE)

    def _fail(
        self, text: str, cause: BaseException | None = None, later: XferError | None = None
    ) -> None:
        self.error = TransferError(
            f"write to peer {self.peer.name} failed: {text}", subject=self.peer.name
        )
        if cause is not None:
            self.error.__cause__ = cause
        # Abort the rest; failures they report later are consequences, attached only.
        for p in self._posted:
            if p.poll() is Status.FAILED and p.error != text:
                self.error.attach(TransferError(p.error, subject=self.peer.name))
        if later is not None:
            self.error.attach(later)
        self._waiting.clear()
        self._finish(Status.FAILED)

    def _finish(self, status: Status) -> None:
        self._status = status
        for p in self._posted:
            try:
                p.release()
            except Exception as exc:
                if self.error is not None:
                    self.error.attach(exc)
                else:  # the data arrived; a driver handle may have leaked
                    log.warning("%s: releasing a completed batch failed: %s", self.peer.name, exc)
        self._posted.clear()

    @property
    def descriptors(self) -> int:
        return len(self.descs)

    @property
    def nbytes(self) -> int:
        return self.descs.total_bytes

    def poll(self) -> Status:
        if self._status is Status.PENDING:
            self._advance()
        return self._status

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the root-cause ``TransferError`` if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is Status.PENDING:
            left = 0.01 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TransferError(
                    f"write to peer {self.peer.name} still pending after {timeout} s",
                    subject=self.peer.name,
                )
            pending = next((p for p in self._posted if p.poll() is Status.PENDING), None)
            if pending is None:
                continue  # the next batch is about to be posted by poll()
            pending.block(min(left, 0.01))
        if self.error is not None:
            raise self.error


class Backend(ABC):
    """A transfer driver behind the core's guards. Use as a context manager."""

    name: ClassVar[str]
    capabilities: Capabilities = Capabilities()

    def __init__(self) -> None:
        self._manifest: Manifest | None = None
        self._local: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._peers: list[Peer] = []
        self._closed = False

    # -- the public contract (core) --------------------------------------

    @property
    def manifest(self) -> Manifest | None:
        """What is registered now."""
        return self._manifest

    def register(self, manifest: Manifest) -> None:
        """Register every region of ``manifest``, or none: on failure, roll back and raise."""
        self._check_open()
        if self._manifest is not None:
            raise RegistrationError(
                f"{self.name}: a manifest is already registered; deregister() it first"
            )
        for r in manifest.regions:
            kind = r.device.split(":")[0]
            if kind not in self.capabilities.memory:
                raise CapabilityError(
                    f"{self.name} cannot register region {r.label}: {r.device} memory is not "
                    f"among its memory kinds {sorted(self.capabilities.memory)}",
                    subject=r.key,
                )
        regions = list(manifest.regions)
        try:
            results = list(self._register_batch(regions))[: len(regions)]
        except Exception as exc:  # the driver raised instead of reporting per region
            self._unregister_unknown(regions, exc)
        failed = next((i for i, res in enumerate(results) if res is not None), None)
        if failed is None and len(results) != len(regions):
            failed = len(results)
            results.append(RuntimeError("driver returned too few results"))
        if failed is not None:
            cause = results[failed]
            r = regions[failed]
            error = RegistrationError(
                f"{self.name} failed to register region {r.label} "
                f"[{r.addr:#x}, +{r.nbytes}) on {r.device}: {cause}",
                subject=r.key,
            )
            error.__cause__ = cause
            done = [reg for reg, res in zip(regions, results, strict=False) if res is None]
            for reg in reversed(done):
                try:
                    self._deregister_region(reg)
                except Exception as exc:
                    error.attach(exc)
            raise error
        self._manifest = manifest
        self._local = _region_table(manifest)

    def _unregister_unknown(self, regions: list[Region], cause: Exception) -> None:
        """A batch registration raised: which regions it left registered is unknown."""
        error = RegistrationError(
            f"{self.name} failed while registering {len(regions)} regions (the driver raised "
            f"instead of naming the failing region): {cause}"
        )
        error.__cause__ = cause
        for r in reversed(regions):  # release whatever it held; refusals are expected here
            with contextlib.suppress(Exception):
                self._deregister_region(r)
        raise error

    def deregister(self) -> None:
        """Release every registered region; calling it again does nothing."""
        if self._manifest is None:
            return
        manifest, self._manifest, self._local = self._manifest, None, None
        first: XferError | None = None
        for r in reversed(manifest.regions):
            try:
                self._deregister_region(r)
            except Exception as exc:
                if first is None:
                    first = RegistrationError(
                        f"{self.name} failed to deregister region {r.label}: {exc}",
                        subject=r.key,
                    )
                else:
                    first.attach(exc)
        if first is not None:
            raise first

    def endpoint(self) -> bytes:
        """The opaque bytes a peer passes to ``connect`` to reach this backend."""
        self._check_open()
        env = Endpoint(self.name, CONTRACT_VERSION, socket.gethostname(), os.getpid(), b"")
        return msgspec.msgpack.encode(msgspec.structs.replace(env, blob=self._endpoint()))

    def connect(self, endpoint: bytes, manifest: Manifest) -> Peer:
        """Reach the backend behind ``endpoint``, which advertised ``manifest``."""
        self._check_open()
        try:
            env = msgspec.msgpack.decode(endpoint, type=Endpoint)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{self.name}: malformed endpoint: {exc}") from exc
        if env.backend != self.name or env.contract != CONTRACT_VERSION:
            raise ProtocolError(
                f"{self.name} (contract {CONTRACT_VERSION}) cannot reach an endpoint of "
                f"{env.backend} (contract {env.contract})"
            )
        remote = (env.host, env.pid) != (socket.gethostname(), os.getpid())
        if remote and not self.capabilities.cross_process:
            raise CapabilityError(
                f"{self.name} works within one process only; the endpoint belongs to "
                f"pid {env.pid} on {env.host}"
            )
        name, handle = self._connect(env.blob, manifest)
        peer = Peer(name, env, manifest, handle)
        self._peers.append(peer)
        return peer

    def disconnect(self, peer: Peer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)
            self._disconnect(peer.handle)

    def write(self, peer: Peer, descs: Descriptors, notify: bytes | None = None) -> Transfer:
        """Post ``descs`` (local src -> peer dst); checked in full before anything is posted."""
        self._check_open()
        if notify is not None and not self.capabilities.notifications:
            raise CapabilityError(f"{self.name} does not deliver notifications")
        if peer not in self._peers:
            raise XferError(f"peer {peer.name} is not connected to this {self.name} backend")
        if self._local is None:
            raise BoundsError(f"{self.name}: nothing is registered; register() a manifest first")
        self._check_descriptors(peer, descs)
        step = self.capabilities.max_batch
        if len(descs) == 0:
            # A notification alone still travels, as an empty batch.
            batches = [descs] if notify is not None else []
        elif not step or len(descs) <= step:
            batches = [descs]
        else:
            batches = [
                Descriptors(
                    descs.src[i : i + step], descs.dst[i : i + step], descs.nbytes[i : i + step]
                )
                for i in range(0, len(descs), step)
            ]
        return Transfer(self, peer, descs, batches, notify)

    def notifications(self) -> list[Notification]:
        """Drain the notifications received since the last call."""
        if not self.capabilities.notifications:
            raise CapabilityError(f"{self.name} does not deliver notifications")
        return list(self._notifications())

    def close(self) -> None:
        """Disconnect peers, deregister memory and release the driver; idempotent."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        steps = [lambda p=p: self.disconnect(p) for p in list(self._peers)]
        for step in (*steps, self.deregister, self._close):  # every step runs, whatever fails
            try:
                step()
            except Exception as exc:
                if first is None:
                    first = exc
                elif isinstance(first, XferError):
                    first.attach(exc)
        if first is not None:
            raise first

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- guards ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise XferError(f"this {self.name} backend is closed")

    def _check_descriptors(self, peer: Peer, d: Descriptors) -> None:
        arrays = (d.src, d.dst, d.nbytes)
        if any(
            not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.uint64 for a in arrays
        ) or not (d.src.size == d.dst.size == d.nbytes.size):
            raise BoundsError("descriptors must be three 1-D uint64 arrays of one length")
        least = max(self.capabilities.min_transfer, 1)
        if d.nbytes.size and d.nbytes.min() < least:
            i = int(np.argmax(d.nbytes < least))
            raise BoundsError(
                f"descriptor {i} is {int(d.nbytes[i])} bytes; {self.name} moves at least {least}",
                subject=i,
            )
        assert self._local is not None and self._manifest is not None
        origin = d.origin
        if origin is not None and origin[0] is self._manifest and origin[1] is peer.manifest:
            return  # sealed by a plan over exactly these two manifests: in bounds
        for side, addrs, table, manifest, where in (
            ("source", d.src, self._local, self._manifest, "registered locally"),
            (
                "destination",
                d.dst,
                (peer._starts, peer._ends, peer._order),
                peer.manifest,
                f"advertised by peer {peer.name}",
            ),
        ):
            inside = _inside(addrs, d.nbytes, table[0], table[1])
            if not inside.all():
                i = int(np.argmin(inside))
                raise BoundsError(
                    f"descriptor {i}: {side} [{int(addrs[i]):#x}, +{int(d.nbytes[i])}) lies "
                    f"outside every region {where}" + _nearest(manifest, table, int(addrs[i])),
                    subject=i,
                )

    # -- driver primitives ---------------------------------------------------

    def _register_batch(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        """Register regions; one result per region (None = registered), stop at the first failure.

        Override to use a driver's batch call; the core rolls back the
        successful ones when any failed.
        """
        results: list[BaseException | None] = []
        for r in regions:
            try:
                self._register_region(r)
            except Exception as exc:
                results.append(exc)
                break
            results.append(None)
        return results

    @abstractmethod
    def _register_region(self, region: Region) -> None: ...

    @abstractmethod
    def _deregister_region(self, region: Region) -> None: ...

    @abstractmethod
    def _endpoint(self) -> bytes:
        """The driver's part of the endpoint."""

    @abstractmethod
    def _connect(self, blob: bytes, manifest: Manifest) -> tuple[str, Any]:
        """(peer name, driver handle) for a peer's endpoint blob."""

    def _disconnect(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """Forget a peer."""

    @abstractmethod
    def _post(self, handle: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        """Start one batch of at most ``max_batch`` descriptors.

        Deliver ``notify`` to the peer after the batch's data. A batch may be
        empty when it only carries a notification.
        """

    def _notifications(self) -> Sequence[Notification]:
        return ()

    def _close(self) -> None:  # noqa: B027 - optional hook
        """Release the driver."""


def _nearest(manifest: Manifest, table, addr: int) -> str:
    starts, _, order = table
    if not starts.size:
        return " (none are)"
    i = max(int(np.searchsorted(starts, addr, side="right")) - 1, 0)
    r = manifest.regions[int(order[i])]
    return f"; nearest is {r.label} [{r.addr:#x}, +{r.nbytes})"
