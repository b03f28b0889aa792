"""The guarded object an engine holds: a driver behind the core's checks.

``Backend`` is final and holds a ``Driver`` (httpx's ``Client`` holding a
transport). It refuses whatever a driver must never see, once, for every
driver: use after ``close``, an endpoint asked before registration, memory of
a kind the driver does not declare, zero-length or out-of-bounds descriptors,
malformed endpoint blobs. It keeps registration all-or-nothing, counts
connections per remote, splits writes to the driver's batch limit, ends every
transfer before memory or a connection goes away, and reports the first real
error with the driver's own text.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, NoReturn, final

import msgspec
import numpy as np

from .arguments import expect, seconds
from .closing import Closing
from .descriptors import Descriptors
from .driver import CONTRACT_VERSION, Capabilities, Driver, Notification, Posted, Status
from .endpoint import Envelope, open_envelope
from .errors import (
    BoundsError,
    CapabilityError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
    keep_first,
)
from .guarded import guard
from .manifest import Manifest, Region
from .transfer import Transfer

log = logging.getLogger("xferkit")

DRAIN_S = 10.0
"""How long ``close``/``deregister``/``disconnect`` wait for aborted batches to leave the driver."""


class _Link:
    """One connection to a remote address, shared by every ``Peer`` naming it."""

    __slots__ = ("address", "blob", "handle", "users")

    def __init__(self, address: str, blob: bytes, handle: Any) -> None:
        self.address, self.blob, self.handle = address, blob, handle
        self.users = 0


@final
class Peer:
    """A connected remote backend and the memory it advertised."""

    __slots__ = ("_link", "backend", "generation", "manifest", "name")

    def __init__(self, backend: str, link: _Link, manifest: Manifest, generation: int) -> None:
        self.name = f"{backend}:{link.address}"
        self.backend = backend
        self.manifest = manifest
        self.generation = generation  # the peer's registration generation in its endpoint
        self._link: _Link | None = link

    def __repr__(self) -> str:
        return f"Peer({self.name!r}, {len(self.manifest)} regions)"


@final
class Backend(Closing):
    """A transfer driver behind the core's guards. Use as a context manager.

    Open one with ``xferkit.open_backend(name, **options)``; driver authors
    build one around their driver with ``Backend(driver)`` in tests.
    """

    def __init__(self, driver: Driver) -> None:
        expect(driver, Driver, "Backend()")
        caps = driver.capabilities
        if not isinstance(caps, Capabilities):
            raise CapabilityError(f"driver {driver!r} declares no Capabilities")
        if caps.notifications:  # Driver's defaults would lose every notification silently
            missing = [
                f"{m}()"
                for m in ("notify", "notifications")
                if getattr(type(driver), m, None) is getattr(Driver, m)
            ]
            if missing:
                raise CapabilityError(
                    f"driver {driver.name} declares notifications=True but does not implement "
                    f"{' and '.join(missing)} (it inherits Driver's default)",
                    subject=driver.name,
                )
        self._driver = driver
        self.name: str = driver.name
        self.capabilities: Capabilities = caps
        self._manifest: Manifest | None = None
        self._generation = 0
        self._links: dict[str, _Link] = {}
        self._peers: set[Peer] = set()
        self._inflight: set[Transfer] = set()
        self._lock = threading.RLock()
        self._closed = False
        # A backend dropped without close() still releases its driver (threads, sockets).
        self._finalizer = weakref.finalize(self, _abandoned, driver)
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"Backend({self.name!r}, {state})"

    @property
    def manifest(self) -> Manifest | None:
        """What is registered now."""
        return self._manifest

    @property
    def generation(self) -> int:
        """Bumped by every ``register`` and ``deregister``: endpoints made before are stale.

        A peer learns it from the endpoint (``Peer.generation``); a control plane
        (the Session) compares it with the current one before posting.
        """
        return self._generation

    @property
    def driver(self) -> Driver:
        """The driver this backend guards (for driver authors' tests and diagnostics)."""
        return self._driver

    # -- memory ----------------------------------------------------------------

    def register(self, manifest: Manifest) -> None:
        """Register every region of ``manifest``, or none: on failure, roll back and raise."""
        self._check_open("register")
        expect(manifest, Manifest, f"{self.name}: register()")
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
            results = list(self._driver.register_regions(regions))[: len(regions)]
        except Exception as exc:  # the driver raised instead of reporting per region
            self._unregister_unknown(regions, exc, "raised")
        failed = next((i for i, res in enumerate(results) if res is not None), None)
        if failed is None and len(results) != len(regions):  # the rest left unsaid: unknown
            missing = RuntimeError("driver returned too few results")
            self._unregister_unknown(regions, missing, f"answered for {len(results)} of them")
        if failed is not None:
            cause = results[failed]
            r = regions[failed]
            error = RegistrationError(
                f"{self.name} failed to register region {r.label} "
                f"[{r.addr:#x}, +{r.nbytes}) on {r.device}: {cause}",
                subject=r.key,
            )
            if isinstance(cause, BaseException):  # else the driver's text, already quoted
                error.__cause__ = cause
            done = [reg for reg, res in zip(regions, results, strict=False) if res is None]
            for reg in reversed(done):
                try:
                    self._driver.deregister_region(reg)
                except Exception as exc:
                    error.attach(exc)
            raise error
        self._manifest = manifest
        self._generation += 1

    def _unregister_unknown(self, regions: list[Region], cause: Exception, how: str) -> NoReturn:
        """A batch registration raised or fell short: which regions it holds is unknown."""
        error = RegistrationError(
            f"{self.name} failed while registering {len(regions)} regions (the driver {how} "
            f"instead of naming the failing region): {cause}"
        )
        error.__cause__ = cause
        for r in reversed(regions):  # release whatever it held; refusals are expected here
            with contextlib.suppress(Exception):
                self._driver.deregister_region(r)
        raise error

    def deregister(self) -> None:
        """End every transfer, then release every registered region; again, it does nothing.

        If a driver still runs a batch ``DRAIN_S`` after it was aborted, nothing is
        released (the engine may still touch that memory): the error says so, the
        manifest stays registered, and a later call tries again.
        """
        self._check_open("deregister")
        self._deregister()

    def _deregister(self) -> None:
        if self._manifest is None:
            return
        stuck = self._end_transfers(self._inflight, "the local memory is being deregistered")
        if stuck is not None:
            raise stuck
        first: XferError | None = None
        manifest, self._manifest = self._manifest, None
        self._generation += 1
        for r in reversed(manifest.regions):
            try:
                self._driver.deregister_region(r)
            except Exception as exc:
                error = RegistrationError(
                    f"{self.name} failed to deregister region {r.label}: {exc}", subject=r.key
                )
                first = keep_first(first, error)
        if first is not None:
            raise first

    # -- peers -----------------------------------------------------------------

    def endpoint(self) -> bytes:
        """The opaque bytes a peer passes to ``connect`` to reach this backend."""
        self._check_open("endpoint")
        if self._manifest is None:
            raise RegistrationError(
                f"{self.name}: endpoint() before register(): the endpoint describes registered "
                "memory, so register a manifest first"
            )
        try:
            part = self._driver.endpoint()
            address = str(self._driver.address)
        except Exception as exc:
            raise self._wrap(exc, "building the endpoint") from exc
        declared = self._driver.Blob
        if not isinstance(part, declared):  # else only the peer would see it, as a missing field
            raise PluginError(
                f"{self.name}: driver endpoint() returned {type(part).__qualname__}, not its "
                f"declared Blob {declared.__qualname__}",
                subject=self.name,
            )
        try:
            blob = msgspec.msgpack.encode(part)
        except Exception as exc:
            raise self._wrap(exc, "encoding the endpoint") from exc
        env = Envelope(
            self.name,
            CONTRACT_VERSION,
            socket.gethostname(),
            os.getpid(),
            address,
            self._generation,
            msgspec.Raw(blob),
        )
        return msgspec.msgpack.encode(env)

    def connect(self, endpoint: bytes, manifest: Manifest) -> Peer:
        """Reach the backend behind ``endpoint``, which advertised ``manifest``."""
        self._check_open("connect")
        expect(manifest, Manifest, f"{self.name}: connect() (the peer's manifest)")
        env, blob = self._open_envelope(endpoint)
        name = f"{self.name}:{env.address}"
        raw = b"%d:" % env.generation + bytes(env.blob)  # what identifies the link
        with self._lock:
            old = self._links.get(env.address)
            if old is not None and old.blob != raw:  # the peer re-registered or restarted
                del self._links[env.address]
                stale = [p for p in self._peers if p._link is old]
                for p in stale:  # refused from now on
                    p._link = None
                ending = {t for t in self._inflight if t.peer in stale}
            else:
                old = None
        if old is not None:  # outside the lock: draining may take a while
            self._retire(old, ending)
        with self._lock:
            link = self._links.get(env.address)
            if link is None or link.blob != raw:
                try:
                    handle = self._driver.connect(blob, manifest)
                except Exception as exc:
                    raise self._wrap(exc, f"connecting to peer {name}", subject=name) from exc
                link = self._links[env.address] = _Link(env.address, raw, handle)
            link.users += 1
            peer = Peer(self.name, link, manifest, env.generation)
            self._peers.add(peer)
        return peer

    def _open_envelope(self, endpoint: object) -> tuple[Envelope, Any]:
        expect(endpoint, (bytes, bytearray, memoryview), f"{self.name}: connect() (the endpoint)")
        env = open_envelope(endpoint, self.name)
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
        try:
            blob = msgspec.msgpack.decode(env.blob, type=self._driver.Blob)
        except msgspec.DecodeError as exc:
            raise ProtocolError(
                f"{self.name}: malformed endpoint blob from {env.address!r}: {exc}"
            ) from exc
        return env, blob

    def disconnect(self, peer: Peer) -> None:
        """End the peer's transfers and forget it; the connection closes with its last peer."""
        self._check_open("disconnect")
        expect(peer, Peer, f"{self.name}: disconnect()")
        self._disconnect(peer)

    def fence(self, source: str) -> None:
        """Cut every connection the peer ``source`` (``Notification.peer``'s spelling) made
        from an endpoint of before: from return on none of their bytes lands here, whatever
        was in flight (``capabilities.fencing``), and ``endpoint()`` is new (a connection
        made from it works)."""
        self._check_open("fence")
        expect(source, str, f"{self.name}: fence()")
        if not self.capabilities.fencing:
            raise CapabilityError(f"{self.name} cannot fence a peer (capabilities.fencing)")
        prefix = f"{self.name}:"
        if not source.startswith(prefix) or source == prefix:
            raise ProtocolError(f"{self.name}: fence({source!r}): not a {self.name} peer")
        try:
            self._driver.fence(source[len(prefix) :])
        except Exception as exc:
            raise self._wrap(exc, f"fencing {source}", source) from exc

    def _disconnect(self, peer: Peer) -> None:
        with self._lock:
            if peer not in self._peers:
                return
            self._peers.discard(peer)
            link, peer._link = peer._link, None
            mine = {t for t in self._inflight if t.peer is peer}
        first = self._end_transfers(mine, f"peer {peer.name} was disconnected")
        if link is not None:
            with self._lock:
                link.users -= 1
                last = link.users == 0 and self._links.get(link.address) is link
                if last:
                    del self._links[link.address]
            if last and (error := self._release_link(link)) is not None:
                first = keep_first(first, error)
        if first is not None:
            raise first

    def _retire(self, link: _Link, ending: set[Transfer]) -> None:
        """A connection replaced by a newer one: end its transfers, then drop it, before the
        driver connects anew (so it never holds the old and the new one busy at once)."""
        why = f"peer {self.name}:{link.address} re-registered or restarted: this peer is stale"
        error = self._end_transfers(ending, why)
        error = self._release_link(link) or error
        if error is not None:  # connect() itself goes on: say so, loudly
            log.warning("%s: retiring the old connection to %s: %s", self.name, link.address, error)

    def _release_link(self, link: _Link) -> XferError | None:
        try:
            self._driver.disconnect(link.handle)
        except Exception as exc:
            return self._wrap(exc, f"disconnecting from {self.name}:{link.address}")
        return None

    # -- transfers -------------------------------------------------------------

    def write(
        self,
        peer: Peer,
        descs: Descriptors,
        notify: bytes | None = None,
        *,
        timeout: float | None = None,
    ) -> Transfer:
        """Post ``descs`` (local src -> peer dst); checked in full before anything is posted.

        ``notify`` reaches the peer after all the data. ``timeout`` (seconds) is the
        write's deadline: past it, the transfer fails (stage: timeout) and is aborted.
        """
        self._check_open("write")
        limit = None if timeout is None else seconds(timeout, "timeout")
        expect(peer, Peer, f"{self.name}: write() (a Peer from connect())")
        expect(descs, Descriptors, f"{self.name}: write()")
        if notify is not None:
            expect(notify, bytes, f"{self.name}: write() (the notification)")
            if not self.capabilities.notifications:
                raise CapabilityError(f"{self.name} does not deliver notifications")
        if peer not in self._peers:
            raise TransferError(
                f"peer {peer.name} is not connected to this {self.name} backend", subject=peer.name
            )
        link = peer._link
        if link is None:
            raise TransferError(
                f"peer {peer.name} is stale: it re-registered or restarted since connect(); "
                "connect() again with its new endpoint",
                subject=peer.name,
            )
        if self._manifest is None:
            raise BoundsError(f"{self.name}: nothing is registered; register() a manifest first")
        self._check_descriptors(peer, descs)
        step = self.capabilities.max_batch
        if len(descs) == 0:
            batches = []
        elif not step or len(descs) <= step:
            batches = [descs]
        else:
            batches = [
                Descriptors(
                    descs.src[i : i + step], descs.dst[i : i + step], descs.nbytes[i : i + step]
                )
                for i in range(0, len(descs), step)
            ]
        driver, handle = self._driver, link.handle

        def post(batch: Descriptors | None, note: bytes | None) -> Posted:
            if batch is None:
                return guard(driver.name, "notify", driver.notify(handle, note or b""))
            return guard(driver.name, "post", driver.post(handle, batch, note))

        transfer = Transfer(peer, descs, batches, notify, post, self._ended, limit)
        with self._lock:  # nobody else holds it yet: it cannot end between the test and the add
            if transfer.poll() is Status.PENDING:
                self._inflight.add(transfer)
        return transfer

    def _ended(self, transfer: Transfer) -> None:
        with self._lock:
            self._inflight.discard(transfer)

    def notifications(self, timeout: float | None = None) -> list[Notification]:
        """Drain the notifications received since the last call.

        With ``timeout`` (seconds), wait up to that long for at least one.
        """
        self._check_open("notifications")
        if not self.capabilities.notifications:
            raise CapabilityError(f"{self.name} does not deliver notifications")
        deadline = None if timeout is None else time.monotonic() + seconds(timeout, "timeout")
        nap = 1e-4
        while True:
            try:
                got = [
                    Notification(f"{self.name}:{sender}", bytes(message))
                    for sender, message in self._driver.notifications()
                ]
            except Exception as exc:
                raise self._wrap(exc, "receiving notifications") from exc
            if got or deadline is None or time.monotonic() >= deadline:
                return got
            time.sleep(min(nap, max(deadline - time.monotonic(), 0)))
            nap = min(nap * 2, 5e-3)

    def notification_fd(self) -> int | None:
        """A descriptor readable when notifications may be waiting (None: the driver has none).

        For event loops: select or poll on it, then call ``notifications()``.
        """
        self._check_open("notification_fd")
        if not self.capabilities.notifications:
            raise CapabilityError(f"{self.name} does not deliver notifications")
        return self._driver.notification_fd()

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        """End every transfer, disconnect peers, deregister memory, release the driver.

        Idempotent; every step runs whatever an earlier one raised, and the
        first failure is the one raised (later ones attached).
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        first: XferError | None = self._end_transfers(self._inflight, "the backend was closed")
        steps = [lambda p=p: self._disconnect(p) for p in list(self._peers)]
        for step in (*steps, self._deregister, self._driver.close):
            try:
                step()
            except Exception as exc:
                first = keep_first(first, self._wrap(exc, "closing"))
        if self._manifest is not None:  # a batch never ended: its memory must outlive us
            for t in self._inflight:
                t._keepalive = self._manifest
        if first is not None:
            raise first

    def _end_transfers(self, transfers: set[Transfer], why: str) -> XferError | None:
        """Abort ``transfers``; return once none can touch memory (bounded by ``DRAIN_S``)."""
        with self._lock:
            ending = list(transfers)
        limit = time.monotonic() + DRAIN_S
        first: XferError | None = None
        for t in ending:
            try:
                t.abort(why, timeout=max(limit - time.monotonic(), 0.0))
            except XferError as exc:
                first = keep_first(first, exc)
        return first

    # -- guards ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise XferError(f"{call}(): this {self.name} backend is closed")

    def _wrap(self, exc: Exception, doing: str, subject: object = None) -> XferError:
        """A driver's exception as an XferError (kept as is when it already is one)."""
        if isinstance(exc, XferError):
            return exc
        error = TransferError(
            f"{self.name}: {doing} failed: {type(exc).__name__}: {exc}", subject=subject
        )
        error.__cause__ = exc
        return error

    def _check_descriptors(self, peer: Peer, d: Descriptors) -> None:
        arrays = (d.src, d.dst, d.nbytes)
        if any(
            not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.uint64 for a in arrays
        ) or not (d.src.size == d.dst.size == d.nbytes.size):
            raise BoundsError("descriptors must be three 1-D uint64 arrays of one length")
        if d.nbytes.size and not d.nbytes.all():
            i = int(np.argmin(d.nbytes))
            raise BoundsError(f"descriptor {i} is 0 bytes; every copy moves at least 1", subject=i)
        local = self._manifest
        assert local is not None
        origin = d.origin
        if origin is not None and origin[0] is local and origin[1] is peer.manifest:
            return  # sealed by a plan over exactly these two manifests: in bounds
        for side, addrs, manifest, where in (
            ("source", d.src, local, "registered locally"),
            ("destination", d.dst, peer.manifest, f"advertised by peer {peer.name}"),
        ):
            i = manifest.first_outside(addrs, d.nbytes)
            if i >= 0:
                near = manifest.nearest(int(addrs[i]))
                hint = (
                    f"; nearest is {near.label} [{near.addr:#x}, +{near.nbytes})"
                    if near is not None
                    else " (none are)"
                )
                raise BoundsError(
                    f"descriptor {i}: {side} [{int(addrs[i]):#x}, +{int(d.nbytes[i])}) lies "
                    f"outside every region {where}{hint}",
                    subject=i,
                )


def _abandoned(driver: Driver) -> None:
    """A backend was garbage-collected unclosed: release its driver (best effort, logged)."""
    try:
        driver.close()
    except Exception as exc:
        log.warning("%s: closing the driver of an abandoned backend: %s", driver.name, exc)
