"""The I/O shell: the only code that touches ZMQ, and the control thread that runs it.

One ROUTER (decode ranks, group members and roster lookups connect to it), one DEALER per
connection the core opens, each with a socket monitor (a refused Curve key, a closed peer),
and a socketpair that wakes the loop. The loop sleeps until a socket, a command or the
core's next deadline, feeds each event to the core (``Protocol``) and carries out its
actions: messages to sockets, driver work to the data-plane worker (``DataPlane``), state
to the engine's handles. It never calls the driver itself, except to drain notifications
and to poll a write whose driver said it ended (``DataPlane.poll_kicked``).
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.auth.thread

from ..backend import Backend
from ..copier import Copier
from ..errors import ProtocolError, XferError
from ..threadname import name_thread
from . import actions as act
from . import sockets, wire
from .core import DRAIN_S, log
from .dataplane import DataPlane
from .dealers import Dealers
from .keys import SessionKeys
from .packer import Packer
from .polling import Cadence
from .protocol import Protocol
from .states import PairEvent

YIELD_S = 5e-5
"""How long the control thread pauses in a burst while the data plane has posts to take."""
BUDGET_S = 0.02
"""The most one pass of the loop spends on commands, or on one socket's messages, before the
timers run: a burst of slow commands on a starved CPU held the Pongs back for seconds."""


class Shell:
    """Sockets, the command queue and the control thread. See the module docstring."""

    def __init__(
        self,
        backend: Backend,
        bind: str,
        keys: SessionKeys | None,
        reconnect: tuple[float, float],
        copier: Copier,
        on_pair: Callable[[PairEvent], None] | None,
    ) -> None:
        self.backend, self.keys, self.reconnect = backend, keys, reconnect
        self.on_pair = on_pair
        self.ctx = zmq.Context()
        try:
            self.router, self._auth = sockets.router(self.ctx, bind, keys)
        except XferError:
            self.ctx.term()
            raise
        self.where = str(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.protocol: Protocol | None = None
        self.lock = threading.Lock()
        self.commands: deque[tuple[Any, ...]] = deque()
        self.progress: list[str] = []
        self._woken, self._until = False, math.inf  # until: this pass's budget ends (BUDGET_S)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_fd = self._wake_r.fileno()
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self.dealers = Dealers(self.ctx, self._poller, keys, reconnect)
        self.packer = Packer(copier, self.event)
        self._driver_work: list[act.Action] = []  # for the data plane, flushed once a pass
        self._notify_fd: int | None = None
        self._poll_notes, self._polls = False, Cadence()  # polled without a descriptor
        self.data = DataPlane(backend, self.event, self.where)
        self._thread: threading.Thread | None = None
        self._closing = self._ended = self._handed = False  # the control thread's

    # -- from any thread -------------------------------------------------------------

    def start(self, protocol: Protocol, notifying: bool) -> None:
        self.protocol = protocol
        if notifying:
            fd = self.backend.notification_fd()
            if fd is not None:
                self._notify_fd = fd
                self._poller.register(fd, zmq.POLLIN)
            self._poll_notes = fd is None
        self._apply(protocol.start())
        name = f"xferkit-session-{self.where}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, command: tuple[Any, ...]) -> bool:
        """Queue a command for the control thread and wake it (once per batch); False once
        the thread has ended (nothing would run it)."""
        with self.lock:
            if self._ended:
                return False
            self.commands.append(command)
            if self._woken:
                return True
            self._woken = True
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closing
            self._wake_w.send(b"\0")
        return True

    def event(self, event: tuple[Any, ...]) -> None:
        """The data plane's and the pack worker's results travel as commands do."""
        self.submit(event)

    def join(self, timeout: float) -> bool:
        """Wait for the control thread to end; False if it has not."""
        if self._thread is not None:
            self._thread.join(min(timeout, threading.TIMEOUT_MAX))  # inf: a lock would raise
            return not self._thread.is_alive()
        return True

    def on_control_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def hand_over(self) -> bool:
        """True while the control thread runs: it then tears down as it ends, not the caller
        that cannot wait for it (which used to close its sockets under it)."""
        with self.lock:
            self._handed = not self._ended
            return self._handed

    def teardown(self) -> None:
        """Release every socket, the context and the workers (the control thread has ended)."""
        self.dealers.close_all()
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        with contextlib.suppress(Exception):
            self.router.close(linger=0)
        with contextlib.suppress(Exception):
            self.ctx.term()
        for s in (self._wake_r, self._wake_w):
            s.close()
        self.packer.stop()
        self.data.stop(1.0)  # a refused Session's (a closed one's has stopped already)

    # -- the control thread ------------------------------------------------------------

    @property
    def _core(self) -> Protocol:
        assert self.protocol is not None  # start() sets it before the thread runs
        return self.protocol

    def _run(self) -> None:
        name_thread("xk-control")
        try:
            while not self._pass(0.05):
                pass
        except Exception:  # a bug: fail everything loudly rather than hang the engine
            log.exception("%s: the session's control thread crashed", self.where)
            try:
                self._close("the session's control thread crashed (see the log)")
            except Exception:  # as it did again: nothing more this thread can do
                log.exception("%s: closing after the crash", self.where)
        finally:
            with self.lock:
                self._ended = True
            if self._handed:  # close() did not wait for this thread: it releases the sockets
                self.teardown()

    def _pass(self, most_s: float) -> bool:
        """One pass of the control thread: wait up to ``most_s`` for something to do, then
        messages, notifications, commands and timers; True once a command closed the session."""
        p = self._core
        # Commands left over by the last pass's budget: no wait.
        wait = 0.0 if self.commands else max(p.next_deadline() - time.monotonic(), 0.0)
        if self._poll_notes and p.incoming.recvs:
            wait = min(wait, self._polls.wait_s)
        events = dict(self._poller.poll(math.ceil(min(wait, most_s) * 1000)))
        active = bool(events)
        if events.pop(self._wake_fd, None) is not None:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        self._until = time.monotonic() + BUDGET_S
        if events.pop(self.router, None) is not None:
            self._drain_router()
            self._until = time.monotonic() + BUDGET_S  # a flood there starves not these
        if events:
            self._drain_dealers(events)
        if (self._notify_fd is not None and events.pop(self._notify_fd, None) is not None) or (
            self._poll_notes and p.incoming.recvs
        ):
            self._polls.passed(self._drain_notifications() or active)  # unused with a descriptor
        self._until = time.monotonic() + BUDGET_S
        if self.commands and self._run_commands():
            return True
        now = time.monotonic()
        if now >= p.next_deadline():
            self._apply(p.timer(now))
        self._flush()
        return False

    def _run_commands(self) -> bool:
        """Run the queued commands; True when one was ``close``."""
        p = self._core
        while True:
            with self.lock:
                if not self.commands:
                    self._woken = False
                    return False
                if time.monotonic() > self._until:
                    return False  # the rest after the timers (the loop polls without waiting)
                cmd = self.commands.popleft()
            self._yield()
            kind, args = cmd[0], cmd[1:]
            now = time.monotonic()
            if kind == "close":
                if not self._closing:  # else close() from a hook the closing itself called
                    self._close(*args)
                return True
            try:
                if kind == "kicked":  # writes whose driver said they ended
                    self._apply(p.writes_ended(self.data.poll_kicked(), now))
                else:
                    self._apply(getattr(p, kind)(*args, now))
            except Exception:
                log.exception("%s: command %s failed", self.where, kind)

    def _close(self, why: str, drain_s: float = DRAIN_S) -> None:
        p = self._core
        self._closing = True
        self._apply(p.close(why, time.monotonic()))
        self._flush()
        limit = time.monotonic() + min(drain_s, DRAIN_S)
        while (self.data.busy or self.commands or p.draining()) and time.monotonic() < limit:
            try:
                self._pass(0.002)  # writes end, sources confirm their aborts
            except Exception:  # closing after a crash: say goodbye all the same
                log.exception("%s: while closing", self.where)
                break
        self._until = math.inf  # every command left runs now
        self._run_commands()
        self._flush()
        self._apply(p.goodbye(why))
        self._flush()
        self.data.stop(1.0)
        time.sleep(0.05)  # let the byes leave before the sockets close

    def _drain_router(self) -> None:
        p = self._core
        more = True  # the poll said a message waits: asking again first would cost a call
        while more and time.monotonic() <= self._until:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EAGAIN aside, said
                if exc.errno != zmq.EAGAIN:
                    log.warning("%s: receiving: %s", self.where, exc)
                return
            more = sockets.waiting(self.router)
            self._yield()
            if len(frames) != 2:
                log.warning("%s: dropped a message of %d frames", self.where, len(frames))
                continue
            ident, data = frames
            msg = self._decode(data, "a decode rank or group member")
            if msg is not None:
                self._apply(p.receive(("down", ident), msg, time.monotonic()))

    def _drain_dealers(self, events: dict[Any, int]) -> None:
        p = self._core
        for sock in list(events):
            conn = self.dealers.conns.get(sock)
            if conn is not None:
                while (
                    self.dealers.socks.get(conn) is sock is not None
                    and sockets.waiting(sock)
                    and time.monotonic() <= self._until
                ):
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.ZMQError:
                        break
                    msg = self._decode(data, str(conn[1]))
                    if msg is not None:
                        self._apply(p.receive(conn, msg, time.monotonic()))
                continue
            conn = self.dealers.monitors.get(sock)
            if conn is not None:
                self._on_monitor(sock, conn)

    def _on_monitor(self, mon: zmq.Socket[Any], conn: act.Conn) -> None:
        p = self._core
        for event in sockets.monitor_events(mon):
            if self.dealers.socks.get(conn) is None:
                return
            now = time.monotonic()
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = f"{conn[1]} refused this session's Curve key (not among its trusted keys)"
                self._apply(p.refused(conn, why, now))
            elif event == zmq.EVENT_DISCONNECTED:
                self._apply(p.disconnected(conn, now))

    def _decode(self, data: bytes, who: str) -> wire.Message | None:
        try:
            return wire.decode(data)
        except ProtocolError as exc:
            log.warning("%s: dropped a message from %s: %s", self.where, who, exc)
            return None

    def _drain_notifications(self) -> bool:  # whether there were any
        p = self._core
        try:
            notes = self.backend.notifications()
        except XferError as exc:
            log.warning("%s: draining notifications: %s", self.where, exc)
            if self.backend.closed:  # by a close() that stopped waiting for this thread: once
                self._poll_notes, fd, self._notify_fd = False, self._notify_fd, None
                with contextlib.suppress(KeyError, zmq.ZMQError):
                    self._poller.unregister(fd)
            return False
        for note in notes:
            self._apply(p.notification(note.peer, note.message, time.monotonic()))
        return bool(notes)

    # -- carrying out actions -------------------------------------------------------------

    def _apply(self, actions: list[act.Action]) -> None:
        driver = self._driver_work
        for a in actions:  # by exact type, commonest first (an isinstance chain cost microseconds)
            if type(a) is act.Send:
                self._send(a.conn, a.msg)
            elif type(a) is act.Move:
                a.handle._move(a.state)
            elif type(a) is act.Post and not driver:
                self.data.post(a)  # small ones at once (dataplane.INLINE_BYTES)
            elif type(a) in act.DRIVER_WORK:
                driver.append(a)
            elif type(a) is act.Routed:
                a.handle._routes, a.handle._timeline = a.routes, a.timeline
            elif type(a) is act.Done:
                a.handle._done()
            elif type(a) is act.Finished:
                with self.lock:
                    self.progress.append(a.rid)
            elif type(a) is act.Failed:
                a.handle._fail(a.error)
            elif type(a) is act.Failing:
                a.handle._failing_now(a.error)
            elif type(a) is act.Paired and self.on_pair is not None:
                try:
                    self.on_pair(a.event)
                except Exception:  # the engine's hook: logged, never lets the Session down
                    log.exception("%s: on_pair(%r) raised", self.where, a.event)
            elif type(a) is act.Open:
                self._open(a.conn)
            elif type(a) is act.Close:
                self.dealers.close(a.conn, a.linger_ms)

    def _flush(self) -> None:
        """Hand the driver work gathered so far to the data plane (one wake-up for it all)."""
        if self._driver_work:
            work, self._driver_work = self._driver_work, []
            self.data.submit(work)

    def _yield(self) -> None:
        """Hand driver work over now and, while the data plane has not taken it yet or the
        driver is behind the writes already posted, pause: CPython gives the GIL to a
        waiting thread only when its holder blocks, so a burst of requests drained back to
        back would otherwise hold every write until the whole burst is in (measured:
        pipelined one-page requests fell to 0.75 of direct writes)."""
        self._flush()
        if self.data.backlog or self.data.behind:
            self.data.behind = False
            time.sleep(YIELD_S)

    def _send(self, conn: act.Conn, msg: wire.Message) -> None:
        try:
            if conn[0] == "down":
                self.router.send_multipart([conn[1], wire.encode(msg)], zmq.NOBLOCK)
            elif (sock := self.dealers.socks.get(conn)) is not None:
                sock.send(wire.encode(msg), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:  # a str that cannot encode: a bug, not fatal
            kind = type(msg).__name__
            log.warning("%s: cannot send %s to %s: %s", self.where, kind, conn[1], exc)

    def _open(self, conn: act.Conn) -> None:
        refused = self.dealers.open(conn)
        if refused is not None:
            p = self._core
            self._apply(p.refused(conn, refused, time.monotonic()))
