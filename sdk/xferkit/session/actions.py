"""What the protocol core asks of the world: the actions its calls return.

The core (``protocol.Protocol``) owns no socket, thread, clock or driver. Each of
its entry points takes an event and ``now`` and returns a list of these; the
shell (``shell.Shell``) carries them out: messages go to a connection, driver
work goes to the data-plane worker, handle changes reach the engine's handles.
A simulator carries them out against simulated networks and drivers instead.

Connections are named, never trusted by what a message says: ``("up", address, n)``
is this decode rank's DEALER to a prefill rank's session address, ``("down",
ident)`` a ROUTER identity (a decode rank or group member that connected to us),
``("group", address)`` a roster lookup, ``("member", server)`` this rank's
registration with its group's roster server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..descriptors import Descriptors
from ..manifest import Manifest
from . import wire
from .states import PairEvent, RequestError, Routes, State
from .timeline import Span

Conn = tuple[Any, ...]
"""A connection: ``(kind, name, ...)``; see the module docstring (a pair's DEALER also
carries a serial: a lost pair's connection may stay open beside a new one to the same
address)."""


class Send(msgspec.Struct, frozen=True):
    """Send ``msg`` on ``conn`` (opened by ``Open`` first, for DEALER kinds)."""

    conn: Conn
    msg: wire.Message


class Open(msgspec.Struct, frozen=True):
    """Open a DEALER for ``conn`` (its name is the session address to reach). A refusal comes
    back as ``Protocol.refused``; a peer whose connection drops, as ``Protocol.disconnected``."""

    conn: Conn


class Close(msgspec.Struct, frozen=True):
    """Close ``conn``'s DEALER; ``linger_ms`` lets messages just queued on it still leave."""

    conn: Conn
    linger_ms: int = 0


class Connect(msgspec.Struct, frozen=True):
    """Connect the backend to a decode rank's endpoint (data-plane worker); answered by
    ``Protocol.connected(key, peer, generation, error)``."""

    key: bytes
    endpoint: bytes
    manifest: Manifest


class Disconnect(msgspec.Struct, frozen=True):
    """Disconnect a backend peer once nothing of ours writes through it."""

    peer: Any


class Post(msgspec.Struct, frozen=True):
    """Post one write (data-plane worker); answered by ``Protocol.write_ended(wid, error)``.

    ``made`` is when the core asked for it and ``horizon`` how long a pause may last before
    its peer may have declared this rank lost and reused the memory: a post still queued
    when the worker finds it was itself stopped that long after ``made`` is refused.
    """

    wid: int
    peer: Any
    descs: Descriptors
    note: bytes | None
    timeout: float
    made: float
    horizon: float


class Cancel(msgspec.Struct, frozen=True):
    """Abort write ``wid``; its ``write_ended`` comes once the driver let go of it."""

    wid: int
    why: str


class Fence(msgspec.Struct, frozen=True):
    """Cut the lost prefill rank ``source``'s connections into our memory (``Backend.fence``,
    data-plane worker); answered by ``Protocol.fenced(source, error, new endpoint)``."""

    source: str


class Move(msgspec.Struct, frozen=True):
    """``handle`` moves forward to ``state`` (never back, never out of a terminal state)."""

    handle: Any
    state: State


class Failing(msgspec.Struct, frozen=True):
    """``handle``'s request fails with ``error``; bytes may still land (draining)."""

    handle: Any
    error: RequestError


class Failed(msgspec.Struct, frozen=True):
    """``handle`` is FAILED: no byte of its request can land any more."""

    handle: Any
    error: RequestError


class Done(msgspec.Struct, frozen=True):
    """``handle`` is DONE."""

    handle: Any


class Routed(msgspec.Struct, frozen=True):
    """How ``handle``'s request went (``Routes``) and where its time went on this rank
    (``timeline``: stage -> ``Span``); comes just before its Done or Failed."""

    handle: Any
    routes: Routes
    timeline: Mapping[str, Span]


class Paired(msgspec.Struct, frozen=True):
    """A pair changed (``PairEvent``): for the engine's ``on_pair`` hook."""

    event: PairEvent


class Finished(msgspec.Struct, frozen=True):
    """``rid`` reached a terminal state here: ``Session.progress`` reports it once."""

    rid: str


Action = (
    Send
    | Open
    | Close
    | Connect
    | Disconnect
    | Post
    | Cancel
    | Fence
    | Move
    | Failing
    | Failed
    | Done
    | Routed
    | Paired
    | Finished
)

DRIVER_WORK = frozenset({Post, Cancel, Connect, Disconnect, Fence})
"""The actions the data-plane worker carries out (``DataPlane``)."""
