"""What every part of the protocol core shares: its settings, its bounds, and the outbox
its calls fill with actions.

Nothing here touches a socket, a thread, a clock or a driver: the parts take
``now`` as an argument and say what must happen as ``actions``.
"""

from __future__ import annotations

import hashlib
import logging
import random
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..copier import Copier
from ..descriptors import Descriptors
from ..manifest import Manifest
from . import actions as act
from . import wire
from .rounds import Arena, Pending
from .states import RequestError, Routes, State
from .timeline import Timeline

log = logging.getLogger("xferkit.session")

REMEMBERED = 1 << 16
"""Finished request ids remembered per session, to refuse duplicates and drop late messages."""
DRAIN_S = 10.0
"""How long a failing request's aborted writes may stay in the driver (told to peers)."""
MAX_PAIRS = 256
"""Most decode ranks a prefill rank keeps pairs with (each may hold a driver connection); a
Hello beyond it is refused with a Welcome saying so."""
MAX_UNOFFERED = 4096
"""Most request ids decode ranks may ask for before this rank's engine ``offer``s them."""
MAX_UNOFFERED_SLOTS = 1 << 24
"""Most slot indices held for requests not offered yet, all of them together (8 bytes each)."""
MAX_EARLY = 4096
"""Most failures kept for requests before the engine's ``offer`` (each a short text)."""

V = TypeVar("V")

PackRunner = Callable[[str, Descriptors], Pending]
"""Starts a pack copy of a request off the control thread; its end comes back as a pump."""


def stage_text(rid: str, stage: str, where: str, detail: str) -> str:
    """The one shape of a root-cause text, so both sides of a request read the same (clipped
    here as on the wire, so the local handle reads what the peer reads)."""
    return wire.clip(f"request {rid!r} failed ({stage}) at {where}: {detail}")


def remember(table: OrderedDict[str, V], key: str, value: V, bound: int = REMEMBERED) -> None:
    """Add to a bounded table, forgetting the oldest."""
    table[key] = value
    while len(table) > bound:
        table.popitem(last=False)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """A Session's settings as the core reads them (validated by the facade)."""

    address: str
    incarnation: int
    manifest: Manifest  # what is registered (the engine's regions and staging)
    pp_rank: int = 0
    pp_size: int = 1
    backend: str
    driver_name: str  # "backend:address" of our own driver, as peers' notifications name it
    endpoint: bytes
    fingerprint: str
    notifying: bool  # the driver carries completion tags on notifications
    pokes: bool = False  # ... and we poll for them (no descriptor): sources poke us (wire.Poke)
    fencing: bool = False  # the driver can cut a lost source's connections (Backend.fence)
    fence_cuts_all: bool = False  # ... and cuts every other source's with them
    ends_are_final: bool = True  # an aborted write lands nothing more (else: a barrier after it)
    descriptor_bytes: int = 4096
    copy_cost: float = 1.0
    staging: str = "never"  # "auto", "always" or "never"
    arena: Arena = field(default_factory=lambda: Arena(0, 0, 0))
    copier: Copier | None = None
    runner: PackRunner | None = None  # starts pack copies off the control thread
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0
    handshake_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    lease_s: float = 30.0
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 2.0
    drain_s: float = DRAIN_S
    max_unoffered: int = MAX_UNOFFERED
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = lambda: 0.0  # times the core's own work (handle.timeline)
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)

    def resume(self, address: str) -> bytes:
        """This rank's ``Hello.resume`` for the prefill at ``address`` (a different digest per
        prefill, so one that learns it cannot pass as this rank to another)."""
        return hashlib.blake2b(address.encode(), key=self.secret, digest_size=16).digest()

    def where(self, side: str) -> str:
        """This rank, as error texts name it."""
        return f"{side} rank {self.manifest.tp_rank} ({self.address})"

    def hello(self) -> dict[str, Any]:
        """What this rank tells each peer about itself (``Hello``/``Welcome``)."""
        return {
            "version": wire.PROTOCOL_VERSION,
            "incarnation": self.incarnation,
            "address": self.address,
            "tp_rank": self.manifest.tp_rank,
            "tp_size": self.manifest.tp_size,
            "fingerprint": self.fingerprint,
            "manifest": self.manifest.encode(),
            "backend": self.backend,
            "endpoint": self.endpoint,
            "driver_address": self.driver_name.partition(":")[2],
        }


class Out:
    """The actions of one call into the core, in order."""

    __slots__ = ("actions",)

    def __init__(self) -> None:
        self.actions: list[act.Action] = []

    def take(self) -> list[act.Action]:
        out, self.actions = self.actions, []
        return out

    def send(self, conn: act.Conn, msg: wire.Message) -> None:
        self.actions.append(act.Send(conn, msg))

    def move(self, handle: Any, state: State) -> None:
        self.actions.append(act.Move(handle, state))

    def routed(self, handle: Any, routes: Routes, timeline: Timeline) -> None:
        self.actions.append(act.Routed(handle, routes, timeline.spans()))

    def done(self, handle: Any, rid: str) -> None:
        self.actions.append(act.Done(handle))
        self.actions.append(act.Finished(rid))

    def failing(self, handle: Any, error: RequestError) -> None:
        self.actions.append(act.Failing(handle, error))

    def failed(self, handle: Any, error: RequestError) -> None:
        self.actions.append(act.Failed(handle, error))
        self.actions.append(act.Finished(error.request_id))

    def add(self, action: act.Action) -> None:
        self.actions.append(action)
