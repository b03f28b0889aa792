"""What the parts of a Session share: its settings, the I/O thread's tables, and the hooks
one part calls in another.

A Session is assembled from one mixin per idea (the loop and sockets, the
handshake, the decode side, the prefill side, liveness, the group roster);
each is a ``Core``, so every part sees the same state. Hooks a part calls in
another part are declared here for the type checker only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from ..backend import Backend
from ..manifest import Manifest
from .handles import State
from .keys import SessionKeys
from .wire import clip

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from ..copier import Copier
    from ..transfer import Transfer
    from . import wire
    from .decode import Recv
    from .handles import Receive, Send, _Handle
    from .handshake import Backoff, Down, Up
    from .prefill import Drain, SendRec
    from .roster import Group, Membership
    from .rounds import Slices

log = logging.getLogger("xferkit.session")

REMEMBERED = 1 << 16
"""Finished request ids remembered per session, to refuse duplicates and drop late messages."""
DRAIN_S = 10.0
"""How long a failing request waits for its transfers to leave the driver."""
POLL_S = 0.001
"""How often the I/O thread polls writes in flight (a driver cannot wake it when one ends)."""
YIELD_S = 5e-5
"""How long the I/O thread pauses between requests while the driver is behind (see
``Loop._yield_if_behind``)."""
LINGER_MS = 500
"""How long a socket closed right after its last messages were queued keeps sending them."""

HWM = 100_000
"""ZMQ high-water mark of every socket: messages queued before a send would block."""

V = TypeVar("V")


def stage_text(rid: str, stage: str, where: str, detail: str) -> str:
    """The one shape of a root-cause text, so both sides of a request read the same (clipped
    here as on the wire, so the local handle reads what the peer reads)."""
    return clip(f"request {rid!r} failed ({stage}) at {where}: {detail}")


def remember(table: OrderedDict[str, V], key: str, value: V) -> None:
    """Add to a bounded table of finished requests, forgetting the oldest."""
    table[key] = value
    while len(table) > REMEMBERED:
        table.popitem(last=False)


class Core:
    """The state every part of the Session reads; the I/O thread alone writes its tables."""

    # settings
    backend: Backend
    manifest: Manifest
    address: str
    incarnation: int
    keys: SessionKeys | None
    heartbeat_s: float
    dead_after_s: float
    handshake_timeout_s: float
    request_timeout_s: float
    lease_s: float
    reconnect_min_s: float
    reconnect_max_s: float
    pp_rank: int
    pp_size: int
    staging: str  # "auto", "always" or "never"
    _slices: Slices
    _copier: Copier
    _notifying: bool
    _poll_notes: bool  # notifications without a descriptor to sleep on: polled while receiving
    # shared with the engine's threads (under _lock)
    _lock: threading.Lock
    _progress: list[str]
    # the I/O thread's
    _ctx: zmq.Context[Any]
    _router: zmq.Socket[Any]
    _poller: zmq.Poller
    _ups: dict[str, Up]
    _by_driver: dict[str, Up]
    _backoff: dict[str, Backoff]
    _downs: dict[bytes, Down]
    _recvs: dict[str, Recv]
    _sends: dict[str, SendRec]
    _writing: dict[str, SendRec]  # the sends with writes in flight (what the loop polls)
    _poll_at: float  # when the loop polls them next
    _behind: bool  # the write posted before the last one was still running when it went
    _posted: bool  # a write was posted in this pass of the loop
    _last_write: Transfer | None
    _drains: list[Drain]
    _finished: OrderedDict[str, None]
    _early: OrderedDict[str, Any]  # rid -> RequestError: failed before offer()
    _failed: OrderedDict[str, Any]  # rid -> RequestError: prefill-side failures
    _gen: int
    _coverage: dict[tuple[Any, ...], Any]
    _groups: dict[str, Group]
    _roster: dict[tuple[int, int], tuple[wire.Join, float]]
    _membership: Membership | None

    def where(self, side: str) -> str:
        """This rank, as error texts name it."""
        return f"{side} rank {self.manifest.tp_rank} ({self.address})"

    def _done(self, handle: _Handle, table: dict[str, Any]) -> None:
        """``handle``'s request completed: DONE, out of ``table``, reported."""
        handle._move(State.DONE)
        del table[handle.request_id]
        self._finish(handle.request_id)

    def _finish(self, rid: str) -> None:
        """``rid`` reached DONE or FAILED here: remember it, report it to ``progress``."""
        remember(self._finished, rid, None)
        with self._lock:
            self._progress.append(rid)

    if TYPE_CHECKING:  # implemented by the parts; declared here for the type checker
        _fail_recv: Callable[..., None]  # decode.DecodeSide._fail_recv
        _fail_send: Callable[..., None]  # prefill.PrefillSide._fail_send

        def _to_up(self, up: Up, msg: wire.Message) -> None: ...
        def _to_down(self, ident: bytes, msg: wire.Message) -> None: ...
        def _dealer(self, address: str) -> zmq.Socket[Any] | str: ...
        def _watch(self, sock: Any, drain: Callable[[], None]) -> None: ...
        def _unwatch(self, sock: Any) -> None: ...
        def _drain_up(self, up: Up) -> None: ...
        def _messages(self, sock: zmq.Socket[Any], who: str) -> list[wire.Message]: ...
        def _send(self, sock: zmq.Socket[Any], msg: wire.Message, to: str) -> None: ...
        def _expand(self, spec: tuple[str, ...], now: float) -> tuple[str, ...] | str | None: ...
        def _open_up(self, address: str, now: float) -> Up | str | None: ...
        def _drop_up(self, up: Up, linger_ms: int = 0) -> None: ...
        def _lose_up(self, up: Up, why: str, stage: str = "peer lost") -> None: ...
        def _lose_down(self, down: Down, why: str) -> None: ...
        def _on_sources(self, rec: Recv) -> None: ...
        def _on_welcome(self, up: Up, msg: wire.Welcome) -> None: ...
        def _try_start(self, rec: Recv) -> None: ...
        def _settle_recv(self, rec: Recv) -> None: ...
        def _forget_group_of(self, address: str) -> None: ...
        def _tick_groups(self, now: float) -> None: ...
        def _leave_group(self) -> None: ...
        def _pair_failed(self, address: str) -> None: ...
        def _poll_drains(self) -> None: ...
        def _on_expect(self, handle: Receive, sources: tuple[str, ...], slots: dict) -> None: ...
        def _on_offer(self, handle: Send) -> None: ...
        def _on_write(self, handle: Send, slots: dict[str, np.ndarray], last: bool) -> None: ...
        def _on_abort(self, handle: _Handle) -> None: ...
        def _on_renew(self, rid: str, sources: tuple[str, ...]) -> None: ...
