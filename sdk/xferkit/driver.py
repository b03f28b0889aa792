"""What a driver plugin implements: the primitives under the core's guards.

A driver is the thin adapter between xferkit and one transfer engine, the way
an httpx transport sits under ``Client``. It never sees a zero-length region
or descriptor, an unchecked address, a malformed endpoint, a call after
``close`` or a connection the core did not count: the ``Backend`` that holds
it has refused all of those first. What is left is the engine's own work:
register memory, reach a peer, post a batch, send a notification.

Call order (the core guarantees it; see docs/plugins.md for what may overlap):
``register_regions`` before ``endpoint``; ``connect`` once per remote address
(reference-counted by the core) before any ``post``/``notify`` to it; every
transfer to a peer ended before ``disconnect``; every transfer ended before
``deregister_region``; ``close`` last, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import pluggy

from .addresses import AddressTable
from .costs import COPY_COST, DESCRIPTOR_BYTES, copy_cost_problem, descriptor_bytes_problem
from .descriptors import Descriptors
from .errors import (
    ArgumentError,
    BoundsError,
    CapabilityError,
    ManifestError,
    OptionError,
    PlanError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from .manifest import Manifest, Region, parse_device
from .options import DriverOptions
from .posted import Done, Posted, Status
from .rdma import INFINIBAND, rdma_devices
from .reach import Advertised
from .threadname import name_thread
from .worker import BatchWorker, QueuedBatch

CONTRACT_VERSION = 2
"""Bumped whenever the driver primitives change; plugins declare the one they implement."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a driver declares it can do; the core checks every request against it."""

    memory: frozenset[str] = frozenset({"cpu"})
    """Device kinds it registers: ``"cpu"`` (host memory), ``"cuda"`` (GPU memory)."""
    notifications: bool = False
    """Whether ``write(..., notify=)`` and ``notifications()`` work."""
    cross_process: bool = False
    """Whether a peer may live in another process (or host); else same-process peers only."""
    max_batch: int = 0
    """Most descriptors per ``post``; the core splits larger writes. 0 means no limit."""
    descriptor_bytes: int = DESCRIPTOR_BYTES
    """What one wire descriptor costs, in bytes the driver could have moved in its place
    (per-descriptor time x bandwidth): staged routes trade descriptors for local copies."""
    copy_cost: float = COPY_COST
    """What one byte copied locally (packing, unpacking) costs, in bytes on this driver's wire:
    its large-copy bandwidth over the local copier's (above 1 where the wire is faster)."""
    fencing: bool = False
    """Whether ``fence(source)`` works: once it returns, nothing the peer ``source`` sends
    through a connection made from an endpoint of before lands here, whatever is in flight,
    and ``endpoint()`` has changed (a connection made from the new one works). A decode
    rank that loses a source then reports FAILED once fenced, not after the source's drain
    bound. A NIC that invalidates the keys it gave the peer can, and so can a receiver
    that applies frames itself (examples/tcp) or retires the registration the peer writes
    to (Mooncake over TCP: see ``fence_cuts_all``)."""
    fence_cuts_all: bool = False
    """Whether ``fence`` cuts every peer's connections into this driver, not only the
    source's: a driver that refuses by registration (Mooncake checks a write against what
    its engine registered, not who sent it) retires the whole registration. The Session
    then treats every pair made from the old endpoint as cut too: their requests fail
    naming the lost source, and the next ones handshake with the new endpoint."""
    ends_are_final: bool = True
    """Whether a write that ended (aborted, failed, timed out, its peer disconnected) lands
    nothing more. A driver that cannot say so (NIXL over UCX's TCP transport: a released
    request's queued puts still go out) declares False and must keep notifications in
    order behind the data: a ``notify`` posted after a write ended reaches the peer after
    every byte of it. The Session then follows each aborted request with such a
    notification, and the decode rank reports FAILED only once it has landed."""

    def __post_init__(self) -> None:

        if not self.memory or not self.memory <= {"cpu", "cuda"}:
            raise OptionError(f"capabilities: memory {sorted(self.memory)} not within cpu, cuda")
        if type(self.max_batch) is not int or self.max_batch < 0:
            raise OptionError(
                f"capabilities: max_batch must be an int >= 0 (0: no limit), not {self.max_batch!r}"
            )
        for problem in (
            descriptor_bytes_problem(self.descriptor_bytes),
            copy_cost_problem(self.copy_cost),
        ):
            if problem:
                raise OptionError(f"capabilities: {problem}")
        for field in (
            "notifications",
            "cross_process",
            "fencing",
            "fence_cuts_all",
            "ends_are_final",
        ):
            if type(getattr(self, field)) is not bool:
                raise OptionError(f"capabilities: {field} must be a bool")
        if not self.ends_are_final and not self.notifications:
            raise OptionError(
                "capabilities: ends_are_final=False needs notifications (the notification "
                "behind a write's last byte is how a receiver learns it ended)"
            )


class Notification(msgspec.Struct, frozen=True):
    """A message a peer attached to a write, delivered after that write's data.

    ``peer`` is the sender's name as ``Peer.name`` spells it on the sending
    side's peers (``backend:address``), so a receiver can tell senders apart.
    """

    peer: str
    message: bytes


class Driver(ABC):
    """The primitives one transfer engine provides. Subclass, declare, implement.

    Declare ``name`` (the backend name), ``Blob`` (the msgspec Struct your
    endpoint carries: the core encodes it and decodes a peer's with it, so a
    malformed one never reaches ``connect``) and ``Options`` (a ``DriverOptions``
    Struct: the core validates them, see ``xferkit.options``), and set
    ``capabilities`` in ``__init__``. ``address`` is this driver's identity
    towards peers (an agent name, a segment): a peer's ``Peer.name`` and a
    receiver's ``Notification.peer`` are ``f"{name}:{address}"``.
    """

    name: ClassVar[str]
    Blob: ClassVar[type[msgspec.Struct]]
    Options: ClassVar[type[DriverOptions] | None] = None
    """The driver's options (a ``DriverOptions`` Struct): ``open_backend`` validates the
    caller's keywords through it and passes ``__init__`` the result. None: ``__init__``'s
    keyword arguments are the options (their names checked, their values the driver's job)."""
    capabilities: Capabilities = Capabilities()
    address: str

    # -- memory ----------------------------------------------------------------

    def register_regions(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        """Register regions: one result per region (None = registered); stop at the first failure.

        Override to use the engine's batch call; the core rolls back the
        registered ones when any failed, and treats a raise as "unknown which".
        """
        results: list[BaseException | None] = []
        for r in regions:
            try:
                self.register_region(r)
            except Exception as exc:
                results.append(exc)
                break
            results.append(None)
        return results

    @abstractmethod
    def register_region(self, region: Region) -> None: ...

    @abstractmethod
    def deregister_region(self, region: Region) -> None: ...

    # -- peers -----------------------------------------------------------------

    @abstractmethod
    def endpoint(self) -> msgspec.Struct:
        """This driver's part of the endpoint (a ``Blob``); asked after registration."""

    @abstractmethod
    def connect(self, blob: Any, manifest: Manifest) -> Any:
        """A connection (any object) to the peer behind ``blob``, which advertised ``manifest``."""

    def disconnect(self, link: Any) -> None:  # noqa: B027 - optional hook
        """Forget a connection; no transfer on it is running."""

    # -- transfers -------------------------------------------------------------

    @abstractmethod
    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        """Start one batch of 1..``max_batch`` checked descriptors; deliver ``notify`` after it."""

    def fence(self, source: str) -> None:
        """Cut every connection the peer ``source`` (its ``address``, as notifications name
        it) made from an endpoint of before: from return on none of their bytes lands, sent
        before or after, and ``endpoint()`` is new. Required when ``fencing`` is declared."""
        raise NotImplementedError(f"{self.name} cannot fence a peer")

    def notify(self, link: Any, message: bytes) -> Posted:
        """Send a notification alone (no data). Required when ``notifications`` is declared."""
        raise NotImplementedError(f"{self.name} does not send notifications alone")

    def notifications(self) -> Sequence[tuple[str, bytes]]:
        """Drain what arrived: (sender address, message) pairs. Never raises for bad input."""
        return ()

    def notification_fd(self) -> int | None:
        """A descriptor that turns readable when notifications may be waiting, or None.

        Optional: an event loop (the Session) then sleeps on it instead of polling
        ``notifications()``. ``notifications()`` makes it unreadable again.
        """
        return None

    def advertised_host(self) -> Advertised | None:
        """The host name or address this driver tells peers to reach it at, and the option that
        sets it; None when it advertises none (its engine's address lists every interface, or
        it reaches one host only). A Session bound beyond this host refuses to start while
        this is a loopback address (``xferkit.reach``)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine; nothing is registered or connected any more."""


# -- announcing a driver ------------------------------------------------------------

hookimpl = pluggy.HookimplMarker("xferkit")
"""Decorate your plugin module's ``register_backends(register)`` with it."""


class BackendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A backend as a plugin announces it, before anything heavy is imported.

    ``name`` is the backend name (``open_backend(name)``; it need not equal the
    entry-point name), ``target`` the driver class as ``"package.module:Class"``,
    ``probe`` a cheap check returning None when usable here, else the reason.
    """

    name: str
    target: str
    contract: int = CONTRACT_VERSION
    probe: Callable[[], str | None] | None = None


__all__ = [
    "CONTRACT_VERSION",
    "INFINIBAND",
    "AddressTable",
    "Advertised",
    "ArgumentError",
    "BackendSpec",
    "BatchWorker",
    "BoundsError",
    "Capabilities",
    "CapabilityError",
    "Descriptors",
    "Done",
    "Driver",
    "DriverOptions",
    "Manifest",
    "ManifestError",
    "Notification",
    "OptionError",
    "PlanError",
    "PluginError",
    "Posted",
    "ProtocolError",
    "QueuedBatch",
    "Region",
    "RegistrationError",
    "Status",
    "TransferError",
    "XferError",
    "hookimpl",
    "name_thread",
    "parse_device",
    "rdma_devices",
]
