"""The I/O thread and its sockets: the only code that touches ZMQ.

One ROUTER (bound, answering decode ranks, group members and roster
lookups), one DEALER per peer this rank opened, and a socketpair the engine's
threads use to wake the loop after queueing a command. The loop sleeps until
a socket, the engine or the driver (``Backend.notification_fd``) has
something; only writes in flight are polled (no driver can wake it when a
write ends), once a millisecond, preferably when nothing else waits. Each
pass runs the queued commands, drains every readable socket and the
backend's notifications, then polls writes and runs the timers (``_tick``).
Nothing in the loop blocks (a pause of ``YIELD_S`` in a burst aside, see
``_yield_if_behind``): a failing request's writes are aborted without
waiting and settled on a later pass.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.auth.thread

from ..errors import ProtocolError, XferError
from . import wire
from .core import HWM, POLL_S, YIELD_S, Core, log
from .keys import KEY_LEN, SessionKeys

if TYPE_CHECKING:
    from .handshake import Down, Up


class Trust:
    """The ZAP callback: a client key is accepted only if trusted; refusals are logged."""

    def __init__(self, trusted: frozenset[bytes], name: str) -> None:
        self.trusted, self.name = trusted, name

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        log.warning("%s: refused a peer presenting untrusted Curve key %s", self.name, key.decode())
        return False


def _limits(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)


class Loop(Core):
    """Sockets, the command queue and the I/O thread's loop."""

    _auth: zmq.auth.thread.ThreadAuthenticator | None
    _commands: deque[tuple[Any, ...]]
    _woken: bool  # a wake-up is on its way to the I/O thread (under _lock)
    _handlers: dict[Any, Callable[[], None]]
    _wake_r: socket.socket
    _wake_w: socket.socket
    _stop: threading.Event

    def _bind(self, bind: str, keys: SessionKeys | None) -> str:
        """Open the context and the ROUTER; return the endpoint it is bound to."""
        self._ctx = zmq.Context()
        self._auth = None
        self._router = self._ctx.socket(zmq.ROUTER)
        _limits(self._router)
        if keys is not None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", Trust(keys.trusted, bind))
            self._router.curve_secretkey = keys.secret
            self._router.curve_publickey = keys.public
            self._router.curve_server = True
        else:
            log.warning(
                "xferkit Session at %s runs without CurveZMQ keys: anyone who can reach it can "
                "name slots and trigger writes into this rank's memory (pass keys=SessionKeys)",
                bind,
            )
        try:
            self._router.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
        except zmq.ZMQError as exc:
            self._teardown_zmq()
            raise XferError(f"Session cannot bind {bind!r}: {exc}") from None
        self._commands = deque()
        self._woken = False
        self._poll_at = 0.0
        self._behind = False
        self._posted = False
        self._handlers = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._poller = zmq.Poller()
        self._watch(self._router, self._drain_router)
        self._watch(self._wake_r.fileno(), self._drain_wake)
        return str(self._router.getsockopt_string(zmq.LAST_ENDPOINT))

    def _teardown_zmq(self) -> None:
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        with contextlib.suppress(Exception):
            self._router.close(linger=0)
        with contextlib.suppress(Exception):
            self._ctx.term()

    def _submit(self, command: tuple[Any, ...]) -> None:
        """From any thread: queue a command for the I/O thread and wake it (once per batch:
        the thread clears ``_woken`` when it finds the queue empty)."""
        with self._lock:
            self._commands.append(command)
            if self._woken:
                return
            self._woken = True
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closing
            self._wake_w.send(b"\0")

    def _watch(self, sock: Any, drain: Callable[[], None]) -> None:
        self._handlers[sock] = drain
        self._poller.register(sock, zmq.POLLIN)

    def _unwatch(self, sock: Any) -> None:
        self._handlers.pop(sock, None)
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(sock)

    def _dealer(self, address: str) -> zmq.Socket[Any] | str:
        """A DEALER connected to a session address (Curve client with keys), or why not."""
        endpoint, _, key = address.partition("|")
        if (self.keys is None) != (not key):
            return (
                f"{address} {'has no' if key else 'has a'} Curve key but this session "
                f"{'has' if self.keys is not None else 'has no'} keys: both sides need them"
            )
        if self.keys is not None and (len(key) != KEY_LEN or key.encode() not in self.keys.trusted):
            return f"{address}: its Curve key is not among the trusted keys"
        sock = self._ctx.socket(zmq.DEALER)
        _limits(sock)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.reconnect_min_s * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.reconnect_max_s * 1000)))
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = key.encode()
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            return f"cannot connect to {address}: {exc}"
        return sock

    # -- sending and receiving ---------------------------------------------------------

    def _send(self, sock: zmq.Socket[Any], msg: wire.Message, to: str) -> None:
        try:
            sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("%s: cannot send %s to %s: %s", self.address, type(msg).__name__, to, exc)

    def _to_up(self, up: Up, msg: wire.Message) -> None:
        self._send(up.sock, msg, up.address)

    def _to_down(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self._router.send_multipart([ident, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("%s: cannot send %s to a peer: %s", self.address, type(msg).__name__, exc)

    def _messages(self, sock: zmq.Socket[Any], who: str) -> list[wire.Message]:
        """Every message waiting on a DEALER; malformed ones are logged and dropped."""
        out = []
        while (data := self._recv(sock.recv, who)) is not None:
            if (msg := self._decode(data, who)) is not None:
                out.append(msg)
        return out

    def _recv(self, recv: Callable[[int], Any], where: str) -> Any:
        """One waiting message, or None when none waits (or the socket failed: logged)."""
        try:
            return recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            log.warning("%s: receiving from %s: %s", self.address, where, exc)
            return None

    def _decode(self, data: bytes, who: str) -> wire.Message | None:
        """The message, or None for a malformed one: logged with the sender and dropped."""
        try:
            return wire.decode(data)
        except ProtocolError as exc:
            log.warning("%s: dropped a message from %s: %s", self.address, who, exc)
            return None

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)

    def _yield_if_behind(self) -> None:
        """More work waits and the driver is behind the writes already posted: pause, so
        driver threads that need the GIL (a Python worker per peer) start them now.

        CPython hands the GIL to a waiting thread only when its holder blocks; a burst
        of requests answered back to back would otherwise hold every write until the
        whole burst is posted (measured: the rate of pipelined one-page requests fell by
        a third). A driver that keeps up is never paused.
        """
        if self._behind:
            self._behind = False
            time.sleep(YIELD_S)

    def _waiting(self, sock: zmq.Socket[Any]) -> bool:
        """Whether a message waits on ``sock`` (cheaper than a receive failing with EAGAIN,
        which costs an exception after every drain)."""
        try:
            return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return True  # the receive says what is wrong

    def _drain_router(self) -> None:
        router = self._router
        while self._waiting(router):
            if (frames := self._recv(router.recv_multipart, "the router")) is None:
                break
            self._yield_if_behind()
            if len(frames) != 2:
                log.warning("%s: dropped a message of %d frames", self.address, len(frames))
                continue
            ident, data = frames
            down = self._downs.get(ident)
            try:
                msg = wire.decode(data)
            except ProtocolError as exc:
                who = down.where() if down is not None else "an unknown peer"
                log.warning("%s: dropped a message from %s: %s", self.address, who, exc)
                continue
            if isinstance(msg, wire.Hello):
                self._on_hello(ident, msg)
            elif isinstance(msg, wire.Join | wire.Lookup):
                self._on_roster_message(ident, msg)
            elif down is None:
                log.warning(
                    "%s: %s from a peer that never said Hello: dropped",
                    self.address,
                    type(msg).__name__,
                )
            else:
                down.last_seen = time.monotonic()
                self._on_down_message(down, msg)

    def _drain_up(self, up: Up) -> None:
        while self._waiting(up.sock) and (data := self._recv(up.sock.recv, up.address)) is not None:
            if (msg := self._decode(data, up.address)) is None:
                continue
            up.last_seen = time.monotonic()
            self._on_up_message(up, msg)
            if self._ups.get(up.address) is not up:
                return

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = 0.0
        wake = self._wake_r.fileno()
        try:
            while not self._stop.is_set():
                # Sleep until a socket, the engine or the driver says something; only writes
                # in flight, aborts draining and drivers that cannot wake us are polled.
                busy = self._writing or self._drains or (self._recvs and self._poll_notes)
                events = dict(self._poller.poll(1 if busy else 50))
                idle = not events
                if events.pop(wake, None) is not None:
                    self._drain_wake()  # before the commands: a later wake stays readable
                if self._commands and self._run_commands():
                    break
                for sock in events:
                    drain = self._handlers.get(sock)
                    if drain is not None:
                        drain()
                self._behind = False  # a burst ends with the pass that took it
                if self._recvs and self._poll_notes:
                    self._drain_notifications()
                now = time.monotonic()
                # Writes in flight: polled once a millisecond, when nothing else is to be done
                # (a write just posted then has the GIL to itself to start), a little late
                # when there always is.
                late = now - self._poll_at
                posted, self._posted = self._posted, False
                if self._writing and late >= 0 and (idle or late >= (4 if posted else 1) * POLL_S):
                    self._poll_at = now + POLL_S
                    self._poll_transfers()
                if self._drains:
                    self._poll_drains()
                if now >= next_tick:
                    next_tick = now + min(self.heartbeat_s / 4, 0.05)
                    self._tick(now)
        except Exception:  # a bug: fail everything loudly rather than hang the engine
            log.exception("%s: the session's I/O thread crashed", self.address)
            self._shutdown("closed", "the session's I/O thread crashed (see the log)")
        finally:
            for sock in list(self._handlers):
                if isinstance(sock, zmq.Socket) and sock is not self._router:
                    sock.close(linger=0)
            self._handlers.clear()

    def _run_commands(self) -> bool:
        """Run the queued engine commands; True when one was ``close``."""
        while True:
            with self._lock:
                if not self._commands:
                    self._woken = False
                    return False
                cmd = self._commands.popleft()
            self._yield_if_behind()
            kind, args = cmd[0], cmd[1:]
            if kind == "close":
                self._shutdown("closed", f"session {self.address} was closed")
                return True
            try:
                getattr(self, f"_on_{kind}")(*args)
            except Exception:
                log.exception("%s: command %s failed", self.address, kind)

    if TYPE_CHECKING:  # the parts' handlers

        def _on_hello(self, ident: bytes, msg: wire.Hello) -> None: ...
        def _on_roster_message(self, ident: bytes, msg: wire.Join | wire.Lookup) -> None: ...
        def _on_down_message(self, down: Down, msg: wire.Message) -> None: ...
        def _on_up_message(self, up: Up, msg: wire.Message) -> None: ...
        def _drain_notifications(self) -> None: ...
        def _poll_transfers(self) -> None: ...
        def _poll_drains(self) -> None: ...
        def _tick(self, now: float) -> None: ...
        def _shutdown(self, stage: str, why: str) -> None: ...
