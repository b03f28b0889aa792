"""One Session per rank: the engine-facing object that moves requests between ranks.

Everything that touches ZMQ, the backend's connections and its notifications
runs on one background I/O thread. Engine calls validate their arguments,
queue a command, wake the thread through a socketpair and return: only
``wait`` and ``abort`` block, and only when asked to.

A decode rank opens one DEALER per prefill rank it expects data from and
handshakes once per pair (``Hello`` / ``Welcome``); a prefill rank answers on
its ROUTER. Per request, each decode rank sends one ``Request`` to each source
rank; the source expands its plan and writes, and the completion rides on the
driver's notification after the data (a ``Tag``). See docs/engine.md and
docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import zmq
import zmq.auth.thread

from ..backend import Backend, Peer
from ..closing import Closing
from ..driver import Status
from ..errors import ManifestError, PlanError, ProtocolError, XferError
from ..manifest import Manifest
from ..planner import Plan, coverage, plan
from ..transfer import Transfer, seconds
from . import wire
from .handles import Receive, RequestError, Send, State, _Handle
from .keys import KEY_LEN, SessionKeys

log = logging.getLogger("xferkit.session")

REMEMBERED = 1 << 16
"""Finished request ids remembered per session, to refuse duplicates and drop late messages."""
DRAIN_S = 10.0
"""How long a failing request waits for its transfers to leave the driver."""


def _stage_text(rid: str, stage: str, where: str, detail: str) -> str:
    return f"request {rid!r} failed ({stage}) at {where}: {detail}"


def fingerprint(manifest: Manifest) -> str:
    """A TP-independent digest of the layout: per region key its global slot shape, itemsize
    and sharding. Two engines serving one model agree on it (diagnostics; the plan decides)."""
    h = hashlib.sha256()
    for r in sorted(manifest.regions, key=lambda r: r.key):
        shape = list(r.slot_shape)
        if r.tp_axis is not None:
            shape[r.tp_axis] = r.tp_global or shape[r.tp_axis] * manifest.tp_size
        h.update(repr((r.key, shape, r.itemsize, r.tp_axis, r.tp_groups)).encode())
    return h.hexdigest()[:16]


# -- the I/O thread's records ----------------------------------------------------------


class _Up:
    """A prefill rank as a decode rank sees it: our DEALER to its ROUTER."""

    def __init__(self, address: str, sock: zmq.Socket, now: float) -> None:
        self.address = address
        self.sock = sock
        self.welcome: wire.Welcome | None = None
        self.manifest: Manifest | None = None
        self.driver_name = ""
        self.hello_at = now
        self.last_seen = now
        self.last_ping = now

    @property
    def ready(self) -> bool:
        return self.welcome is not None

    def where(self) -> str:
        rank = "?" if self.welcome is None else self.welcome.tp_rank
        return f"prefill rank {rank} ({self.address})"


class _Down:
    """A decode rank as a prefill rank sees it: a ROUTER identity that said Hello."""

    def __init__(self, ident: bytes, hello: wire.Hello, now: float) -> None:
        self.ident = ident
        self.hello = hello
        self.manifest: Manifest | None = None
        self.peer: Peer | None = None
        self.plan: Plan | None = None
        self.error: tuple[str, str] | None = None
        self.last_seen = now

    def where(self) -> str:
        return f"decode rank {self.hello.tp_rank} ({self.hello.address})"


class _Source:
    """What a decode request still needs from one source rank."""

    __slots__ = ("rank", "seen", "total")

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.total = rank, 0, 0

    @property
    def complete(self) -> bool:
        return self.total > 0 and self.seen >= self.total


class _Recv:
    def __init__(
        self, handle: Receive, gen: int, sources: tuple[str, ...], slots: dict, deadline: float
    ) -> None:
        self.handle = handle
        self.rid = handle.request_id
        self.gen = gen
        self.sources = sources
        self.slots: dict[str, np.ndarray] = slots
        self.deadline = deadline
        self.needed: dict[str, _Source] = {}
        self.requested: set[str] = set()
        self.started = False
        self.error: tuple[str, str, str | None] | None = None  # stage, text, peer
        self.acks: set[str] = set()
        self.drain_at = 0.0


class _Dst:
    """One decode rank's part of a prefill request."""

    def __init__(self, down: _Down, msg: wire.Request) -> None:
        self.down = down
        self.gen = msg.gen
        self.needed = msg.needed
        self.slots = {p: np.asarray(s, dtype=np.int64) for p, s in msg.slots.items()}
        self.cursor = dict.fromkeys(self.slots, 0)
        self.seq = 0
        self.last = False
        self.transfers: list[tuple[Transfer, wire.Tag | None]] = []  # tag None: completed


class _SendRec:
    def __init__(self, rid: str, deadline: float) -> None:
        self.rid = rid
        self.handle: Send | None = None
        self.dsts: dict[int, _Dst] = {}
        self.dst_size: int | None = None
        self.chunks: list[tuple[dict[str, np.ndarray], bool]] = []
        self.last = False
        self.deadline = deadline
        self.error: RequestError | None = None


class _Trust:
    """The ZAP callback: a client key is accepted only if trusted; refusals are logged."""

    def __init__(self, trusted: frozenset[bytes], name: str) -> None:
        self.trusted, self.name = trusted, name

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        log.warning("%s: refused a peer presenting untrusted Curve key %s", self.name, key.decode())
        return False


# -- the session -------------------------------------------------------------------------


class Session(Closing):
    """One rank's transfer session. See docs/engine.md.

    It owns ``backend`` (registering ``manifest`` if nothing is registered yet)
    and closes it on ``close``.
    """

    def __init__(
        self,
        backend: Backend,
        manifest: Manifest,
        *,
        bind: str = "tcp://127.0.0.1:0",
        keys: SessionKeys | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        handshake_timeout_s: float = 10.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        if not isinstance(backend, Backend):
            raise XferError(f"Session needs a xferkit.Backend, not {backend!r}")
        if not isinstance(manifest, Manifest):
            raise XferError(f"Session needs a Manifest, not {manifest!r}")
        if keys is not None and not isinstance(keys, SessionKeys):
            raise XferError(f"keys must be SessionKeys or None, not {keys!r}")
        if not isinstance(bind, str) or not bind.startswith(("tcp://", "ipc://")):
            raise XferError(f"bind must be a tcp:// or ipc:// address, not {bind!r}")
        self.heartbeat_s = seconds(heartbeat_s, "heartbeat_s")
        self.dead_after_s = seconds(dead_after_s, "dead_after_s")
        self.handshake_timeout_s = seconds(handshake_timeout_s, "handshake_timeout_s")
        self.request_timeout_s = seconds(request_timeout_s, "request_timeout_s")
        if self.dead_after_s <= self.heartbeat_s:
            raise XferError(
                f"dead_after_s ({dead_after_s}) must exceed heartbeat_s ({heartbeat_s})"
            )
        if backend.manifest is None:
            backend.register(manifest)
        elif backend.manifest != manifest:
            raise XferError("the backend has another manifest registered than the one given")
        self.backend = backend
        self.manifest = manifest
        self.incarnation = random.getrandbits(63)
        self.keys = keys
        self._endpoint = backend.endpoint()
        self._fingerprint = fingerprint(manifest)
        self._notifying = backend.capabilities.notifications

        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE)
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        if keys is not None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _Trust(keys.trusted, bind))
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
        where = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address: str = where if keys is None else f"{where}|{keys.public.decode()}"
        """The string a peer passes to ``expect(source=...)``."""

        self._lock = threading.Lock()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._used: OrderedDict[str, None] = OrderedDict()  # ids given to expect/offer
        self._progress: list[str] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        # I/O thread state
        self._ups: dict[str, _Up] = {}
        self._by_driver: dict[str, _Up] = {}
        self._downs: dict[bytes, _Down] = {}
        self._recvs: dict[str, _Recv] = {}
        self._sends: dict[str, _SendRec] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._early: OrderedDict[str, RequestError] = OrderedDict()  # failed before offer()
        self._failed: OrderedDict[str, RequestError] = OrderedDict()  # prefill-side failures
        self._gen = 0
        self._coverage: dict[tuple, Any] = {}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"xferkit-session-{where}")
        self._thread.daemon = True
        self._thread.start()

    def __repr__(self) -> str:
        return f"Session({self.address!r}, rank {self.manifest.tp_rank}/{self.manifest.tp_size})"

    # -- engine calls ----------------------------------------------------------------

    def expect(
        self, request_id: str, source: str | Iterable[str], slots: Mapping[str, Any]
    ) -> Receive:
        """Decode side: receive ``request_id`` into ``slots[pool]`` from the source ranks whose
        session addresses are ``source`` (all of them; the plans pick the ones needed)."""
        self._check_open("expect")
        rid = self._check_id(request_id)
        sources = (source,) if isinstance(source, str) else tuple(source)
        if not sources or not all(isinstance(s, str) and s for s in sources):
            raise XferError(f"expect(source=) takes session addresses, not {source!r}")
        if len(set(sources)) != len(sources):
            raise XferError(f"expect(source=) names an address twice: {sources}")
        checked = self._local_slots(slots, f"request {rid!r}: expect()")
        self._claim(rid)
        handle = Receive(self, rid)
        self._submit(("expect", handle, sources, checked))
        return handle

    def offer(self, request_id: str) -> Send:
        """Prefill side: the request ``request_id`` will be written from here (``Send.write``)."""
        self._check_open("offer")
        rid = self._check_id(request_id)
        self._claim(rid)
        handle = Send(self, rid)
        self._submit(("offer", handle))
        return handle

    def progress(self) -> list[str]:
        """The request ids that finished (DONE or FAILED) since the last call."""
        with self._lock:
            out, self._progress = self._progress, []
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Fail every open request on both sides, tell the peers, release sockets and backend."""
        if self._closed:
            return
        self._closed = True
        self._submit(("close",))
        self._thread.join(seconds(timeout, "timeout"))
        if self._thread.is_alive():
            log.warning("%s: the I/O thread did not stop within %s s", self.address, timeout)
            self._stop.set()
            self._thread.join(1.0)
        self._teardown_zmq()
        self._wake_r.close()
        self._wake_w.close()
        self.backend.close()

    # -- checks on the engine's thread -----------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise XferError(f"{call}(): session {self.address} is closed")

    @staticmethod
    def _check_id(request_id: object) -> str:
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
            raise XferError(f"a request id is a str of 1..256 characters, not {request_id!r}")
        return request_id

    def _claim(self, rid: str) -> None:
        with self._lock:
            if rid in self._used:
                raise XferError(
                    f"request id {rid!r} was already used on this session: ids are single-use",
                    subject=rid,
                )
            self._used[rid] = None
            while len(self._used) > REMEMBERED:
                self._used.popitem(last=False)

    def _local_slots(self, slots: object, what: str) -> dict[str, np.ndarray]:
        """Slot indices per pool, checked against this rank's manifest."""
        if not isinstance(slots, Mapping) or not slots:
            raise XferError(f"{what}: slots map pool -> slot indices, not {slots!r}")
        pools = self.manifest.pools
        known = set(pools) | {k[0] for k in self.manifest.dropped_keys}
        out: dict[str, np.ndarray] = {}
        for pool, raw in slots.items():
            if pool not in known:
                raise XferError(f"{what}: unknown pool {pool!r}; this rank has {sorted(known)}")
            try:
                arr = np.asarray(raw)
            except Exception:
                arr = np.zeros((0, 0))
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise XferError(f"{what}: pool {pool!r}: slot indices must be 1-D integers")
            arr = arr.astype(np.int64)
            count = pools.get(pool)
            if arr.size and (arr.min() < 0 or (count is not None and arr.max() >= count)):
                raise XferError(f"{what}: pool {pool!r}: a slot is out of range [0, {count})")
            if np.unique(arr).size != arr.size:
                raise XferError(f"{what}: pool {pool!r}: a slot is named twice")
            out[pool] = arr
        return out

    def _submit(self, command: tuple[Any, ...]) -> None:
        with self._lock:
            self._commands.append(command)
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _teardown_zmq(self) -> None:
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        with contextlib.suppress(Exception):
            self._router.close(linger=0)
        with contextlib.suppress(Exception):
            self._ctx.term()

    # == the I/O thread ===============================================================

    def _run(self) -> None:
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                busy = bool(self._recvs or self._sends)
                events = dict(self._poller.poll(1 if busy else 50))
                if self._wake_r.fileno() in events:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                if self._commands and self._run_commands():
                    break
                if self._router in events:
                    self._drain_router()
                for up in list(self._ups.values()):
                    if up.sock in events:
                        self._drain_up(up)
                if self._recvs and self._notifying:
                    self._drain_notifications()
                if self._sends:
                    self._poll_transfers()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + min(self.heartbeat_s / 4, 0.05)
                    self._tick(now)
        except Exception:  # a bug: fail everything loudly rather than hang the engine
            log.exception("%s: the session's I/O thread crashed", self.address)
            self._shutdown("closed", "the session's I/O thread crashed (see the log)")
        finally:
            for up in list(self._ups.values()):
                up.sock.close(linger=0)
            self._ups.clear()

    def _run_commands(self) -> bool:
        while True:
            with self._lock:
                if not self._commands:
                    return False
                cmd = self._commands.popleft()
            kind = cmd[0]
            if kind == "close":
                self._shutdown("closed", f"session {self.address} was closed")
                return True
            try:
                if kind == "expect":
                    self._on_expect(*cmd[1:])
                elif kind == "offer":
                    self._on_offer(cmd[1])
                elif kind == "write":
                    self._on_write(*cmd[1:])
                elif kind == "abort":
                    self._on_abort(cmd[1])
            except Exception:
                log.exception("%s: command %s failed", self.address, kind)

    # -- sending -----------------------------------------------------------------------

    def _to_up(self, up: _Up, msg: wire.Message) -> None:
        try:
            up.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning(
                "%s: cannot send %s to %s: %s", self.address, type(msg).__name__, up.address, exc
            )

    def _to_down(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self._router.send_multipart([ident, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning(
                "%s: cannot send %s to a decode rank: %s", self.address, type(msg).__name__, exc
            )

    def _hello(self) -> dict[str, Any]:
        return {
            "version": wire.PROTOCOL_VERSION,
            "incarnation": self.incarnation,
            "address": self.address,
            "tp_rank": self.manifest.tp_rank,
            "tp_size": self.manifest.tp_size,
            "fingerprint": self._fingerprint,
            "manifest": self.manifest.encode(),
            "backend": self.backend.name,
            "endpoint": self._endpoint,
            "driver_address": str(self.backend.driver.address),
        }

    def _done(self, rec: Any, table: dict[str, Any]) -> None:
        rec.handle._move(State.DONE)
        del table[rec.rid]
        self._finish(rec.rid)

    def _finish(self, rid: str) -> None:
        self._finished[rid] = None
        while len(self._finished) > REMEMBERED:
            self._finished.popitem(last=False)
        with self._lock:
            self._progress.append(rid)

    # == decode side ==================================================================

    def _up(self, address: str, now: float) -> _Up | str:
        """Our connection to a prefill rank, opened (and Hello sent) on first use; or why not."""
        up = self._ups.get(address)
        if up is not None:
            return up
        endpoint, _, key = address.partition("|")
        if (self.keys is None) != (not key):
            return (
                f"{address} {'has no' if key else 'has a'} Curve key but this session "
                f"{'has' if self.keys is not None else 'has no'} keys: both sides need them"
            )
        if self.keys is not None and (len(key) != KEY_LEN or key.encode() not in self.keys.trusted):
            return f"{address}: its Curve key is not among the trusted keys"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = key.encode()
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            return f"cannot connect to {address}: {exc}"
        up = self._ups[address] = _Up(address, sock, now)
        self._poller.register(sock, zmq.POLLIN)
        self._to_up(up, wire.Hello(**self._hello()))
        return up

    def _on_expect(self, handle: Receive, sources: tuple[str, ...], slots: dict) -> None:
        now = time.monotonic()
        self._gen += 1
        rec = _Recv(handle, self._gen, sources, slots, now + self.request_timeout_s)
        self._recvs[rec.rid] = rec
        for address in sources:
            up = self._up(address, now)
            if isinstance(up, str):
                self._fail_recv(rec, "handshake", up, address)
                return
        self._try_start(rec)

    def _try_start(self, rec: _Recv) -> None:
        """Send the Requests once every source has answered the handshake."""
        if rec.started or rec.error is not None:
            return
        ups = [self._ups.get(a) for a in rec.sources]
        if not all(u is not None and u.ready for u in ups):
            return
        rec.started = True
        live = [u for u in ups if u is not None]
        key = tuple((u.address, u.welcome.incarnation if u.welcome else 0) for u in live)
        cov = self._coverage.get(key)
        if cov is None:
            try:
                cov = coverage([u.manifest for u in live if u.manifest is not None], self.manifest)
            except PlanError as exc:
                cov = exc
            if len(self._coverage) > 256:
                self._coverage.clear()
            self._coverage[key] = cov
        if isinstance(cov, PlanError):
            text = _stage_text(rec.rid, "plan", f"decode rank {self.manifest.tp_rank}", str(cov))
            self._fail_recv(rec, "plan", text, None, formatted=True)
            return
        for i in cov.sources:
            u = live[i]
            assert u.welcome is not None
            rec.needed[u.address] = _Source(u.welcome.tp_rank)
        lists = {p: s.tolist() for p, s in rec.slots.items()}
        for u in live:
            self._to_up(
                u,
                wire.Request(
                    rid=rec.rid,
                    gen=rec.gen,
                    dst_rank=self.manifest.tp_rank,
                    dst_size=self.manifest.tp_size,
                    needed=u.address in rec.needed,
                    slots=lists,
                ),
            )
            rec.requested.add(u.address)
        rec.handle._move(State.WAITING)
        self._check_recv(rec)

    def _check_recv(self, rec: _Recv) -> None:
        if rec.error is None and rec.started and all(s.complete for s in rec.needed.values()):
            self._done(rec, self._recvs)

    def _fail_recv(
        self,
        rec: _Recv,
        stage: str,
        detail: str,
        peer: str | None,
        *,
        formatted: bool = False,
        quiet: frozenset[str] = frozenset(),
    ) -> None:
        """Fail ``rec`` with this root cause, once every source still writing confirmed it
        stopped (``Abort`` -> ``AbortAck``); sources in ``quiet`` are known to write nothing."""
        if rec.error is not None:
            rec.acks -= quiet
            self._settle_recv(rec)
            return
        text = (
            detail
            if formatted
            else _stage_text(
                rec.rid, stage, f"decode rank {self.manifest.tp_rank} ({self.address})", detail
            )
        )
        rec.error = (stage, text, peer)
        rec.drain_at = time.monotonic()
        abort = wire.Abort(rid=rec.rid, gen=rec.gen, stage=stage, text=text)
        fail = wire.Fail(rid=rec.rid, gen=rec.gen, stage=stage, text=text)
        for address in rec.sources:
            up = self._ups.get(address)
            if up is None or not up.ready or address in quiet:
                continue
            if address in rec.requested:
                self._to_up(up, abort)
                rec.acks.add(address)
            else:  # it never heard of the request from us: tell it, nothing to wait for
                self._to_up(up, fail)
        self._settle_recv(rec)

    def _settle_recv(self, rec: _Recv) -> None:
        if rec.error is None or rec.acks:
            return
        stage, text, peer = rec.error
        rec.handle._fail(RequestError(text, stage=stage, request_id=rec.rid, peer=peer))
        if self._recvs.get(rec.rid) is rec:
            del self._recvs[rec.rid]
            self._finish(rec.rid)

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

    def _drain_up(self, up: _Up) -> None:
        while (data := self._recv(up.sock.recv, up.address)) is not None:
            if (msg := self._decode(data, up.address)) is None:
                continue
            up.last_seen = time.monotonic()
            self._on_up_message(up, msg)
            if self._ups.get(up.address) is not up:
                return

    def _on_up_message(self, up: _Up, msg: wire.Message) -> None:
        if isinstance(msg, wire.Welcome):
            self._on_welcome(up, msg)
        elif up.welcome is None:
            log.warning(
                "%s: %s from %s before its Welcome: dropped",
                self.address,
                type(msg).__name__,
                up.address,
            )
        elif isinstance(msg, wire.Pong):
            if msg.incarnation != up.welcome.incarnation:
                self._lose_up(up, f"{up.where()} restarted (new incarnation)")
        elif isinstance(msg, wire.Fail | wire.AbortAck):
            rec = self._recvs.get(msg.rid)
            if rec is None or rec.gen != msg.gen:
                log.info(
                    "%s: late %s for request %r from %s: dropped",
                    self.address,
                    type(msg).__name__,
                    msg.rid,
                    up.address,
                )
                return
            if isinstance(msg, wire.Fail):
                self._fail_recv(
                    rec,
                    msg.stage,
                    msg.text,
                    up.address,
                    formatted=True,
                    quiet=frozenset({up.address}),
                )
            else:
                rec.acks.discard(up.address)
                self._settle_recv(rec)
        elif isinstance(msg, wire.Written):
            self._completed(up, wire.Tag(msg.rid, msg.gen, msg.src_rank, msg.seq, msg.total))
        elif isinstance(msg, wire.Bye):
            self._lose_up(up, f"{up.where()} closed its session: {msg.reason}")
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped", self.address, type(msg).__name__, up.address
            )

    def _on_welcome(self, up: _Up, msg: wire.Welcome) -> None:
        if up.welcome is not None:
            log.warning("%s: a second Welcome from %s: dropped", self.address, up.address)
            return
        waiting = [r for r in self._recvs.values() if up.address in r.sources and not r.started]
        problem: tuple[str, str] | None = None
        if msg.version != wire.PROTOCOL_VERSION:
            problem = (
                "handshake",
                f"{up.address} speaks protocol {msg.version}, we speak {wire.PROTOCOL_VERSION}",
            )
        elif msg.error:
            problem = (msg.stage or "handshake", msg.error)
        else:
            try:
                up.manifest = Manifest.decode(msg.manifest)
            except ManifestError as exc:
                problem = ("handshake", f"{up.address} sent a malformed manifest: {exc}")
        if problem is not None:
            stage, text = problem
            me = f"decode rank {self.manifest.tp_rank} ({self.address})"
            texts = {  # the prefill side's own text when it sent one
                rec.rid: text if msg.error else _stage_text(rec.rid, stage, me, text)
                for rec in waiting
            }
            for rec in waiting:  # so an offer there fails with the same text, not a timeout
                self._to_up(
                    up, wire.Fail(rid=rec.rid, gen=rec.gen, stage=stage, text=texts[rec.rid])
                )
            self._drop_up(up)
            for rec in waiting:
                self._fail_recv(rec, stage, texts[rec.rid], up.address, formatted=True)
            return
        up.welcome = msg
        up.driver_name = f"{msg.backend}:{msg.driver_address}"
        self._by_driver[up.driver_name] = up
        for rec in waiting:
            self._try_start(rec)

    def _drop_up(self, up: _Up) -> None:
        if self._ups.get(up.address) is up:
            del self._ups[up.address]
        if self._by_driver.get(up.driver_name) is up:
            del self._by_driver[up.driver_name]
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(up.sock)
        up.sock.close(linger=0)

    def _lose_up(self, up: _Up, why: str, stage: str = "peer lost") -> None:
        """A prefill rank is gone (dead, restarted, closed, unreachable): fail what needs it."""
        self._drop_up(up)
        quiet = frozenset({up.address})
        hit = [r for r in self._recvs.values() if up.address in r.sources]
        log.log(logging.WARNING if hit else logging.INFO, "%s: %s", self.address, why)
        for rec in hit:
            self._fail_recv(rec, stage, why, up.address, quiet=quiet)

    def _drain_notifications(self) -> None:
        try:
            notes = self.backend.notifications()
        except XferError as exc:
            log.warning("%s: draining notifications: %s", self.address, exc)
            return
        for note in notes:
            up = self._by_driver.get(note.peer)
            if up is None:
                log.warning(
                    "%s: a notification from unknown driver peer %s: dropped",
                    self.address,
                    note.peer,
                )
                continue
            try:
                tag = wire.decode_tag(note.message)
            except ProtocolError as exc:
                log.warning("%s: notification from %s: %s", self.address, up.address, exc)
                continue
            self._completed(up, tag)

    def _completed(self, up: _Up, tag: wire.Tag) -> None:
        rec = self._recvs.get(tag.rid)
        if rec is None or rec.gen != tag.gen or rec.error is not None:
            log.info(
                "%s: late completion of request %r from %s: dropped",
                self.address,
                tag.rid,
                up.address,
            )
            return
        src = rec.needed.get(up.address)
        if src is None or src.rank != tag.src_rank:
            log.warning(
                "%s: completion of %r from %s, which it does not need: dropped",
                self.address,
                tag.rid,
                up.address,
            )
            return
        src.seen += 1
        if tag.total:
            src.total = tag.total
        rec.handle._move(State.TRANSFERRING)
        self._check_recv(rec)

    # == prefill side ==================================================================

    def _drain_router(self) -> None:
        while (frames := self._recv(self._router.recv_multipart, "the router")) is not None:
            if len(frames) != 2:
                log.warning("%s: dropped a message of %d frames", self.address, len(frames))
                continue
            ident, data = frames
            down = self._downs.get(ident)
            who = down.where() if down is not None else "an unknown peer"
            if (msg := self._decode(data, who)) is None:
                continue
            if isinstance(msg, wire.Hello):
                self._on_hello(ident, msg)
            elif down is None:
                log.warning(
                    "%s: %s from a peer that never said Hello: dropped",
                    self.address,
                    type(msg).__name__,
                )
            else:
                down.last_seen = time.monotonic()
                self._on_down_message(down, msg)

    def _on_hello(self, ident: bytes, msg: wire.Hello) -> None:
        now = time.monotonic()
        old = self._downs.get(ident)
        if old is not None:
            self._lose_down(old, f"{old.where()} said Hello again: starting over")
        down = _Down(ident, msg, now)
        reply = self._hello()
        where = f"prefill rank {self.manifest.tp_rank} ({self.address})"
        if msg.version != wire.PROTOCOL_VERSION:
            down.error = (
                "handshake",
                f"{where} speaks protocol {wire.PROTOCOL_VERSION}, "
                f"{msg.address} speaks {msg.version}",
            )
        elif msg.backend != self.backend.name:
            down.error = (
                "handshake",
                f"{where} uses backend {self.backend.name}, {msg.address} uses {msg.backend}",
            )
        else:
            try:
                down.manifest = Manifest.decode(msg.manifest)
                down.plan = plan(self.manifest, down.manifest)
                down.peer = self.backend.connect(msg.endpoint, down.manifest)
            except PlanError as exc:
                down.error = (
                    "plan",
                    f"plan from {where} to decode rank {msg.tp_rank} ({msg.address}): {exc}",
                )
            except XferError as exc:
                down.error = (
                    "handshake",
                    f"{where} cannot reach decode rank {msg.tp_rank} ({msg.address}): {exc}",
                )
        if down.error is not None:
            log.warning("%s: %s", self.address, down.error[1])
            reply.update(stage=down.error[0], error=down.error[1])
        self._downs[ident] = down
        self._to_down(ident, wire.Welcome(**reply))

    def _on_down_message(self, down: _Down, msg: wire.Message) -> None:
        if isinstance(msg, wire.Ping):
            if msg.incarnation != down.hello.incarnation:
                log.warning(
                    "%s: ping with a changed incarnation from %s: dropped",
                    self.address,
                    down.where(),
                )
                return
            self._to_down(down.ident, wire.Pong(incarnation=self.incarnation))
        elif isinstance(msg, wire.Request):
            self._on_request(down, msg)
        elif isinstance(msg, wire.Abort | wire.Fail):
            self._on_remote_fail(down, msg)
        elif isinstance(msg, wire.Bye):
            self._lose_down(down, f"{down.where()} closed its session: {msg.reason}")
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped", self.address, type(msg).__name__, down.where()
            )

    def _send_rec(self, rid: str) -> _SendRec:
        rec = self._sends.get(rid)
        if rec is None:
            rec = self._sends[rid] = _SendRec(rid, time.monotonic() + self.request_timeout_s)
        return rec

    def _on_request(self, down: _Down, msg: wire.Request) -> None:
        where = f"prefill rank {self.manifest.tp_rank} ({self.address})"
        fail = lambda stage, detail: self._to_down(  # noqa: E731
            down.ident,
            wire.Fail(
                rid=msg.rid,
                gen=msg.gen,
                stage=stage,
                text=_stage_text(msg.rid, stage, where, detail),
            ),
        )
        failed = self._failed.get(msg.rid) or self._early.get(msg.rid)
        if failed is not None:  # it failed here before this rank asked: the root cause
            self._to_down(
                down.ident,
                wire.Fail(rid=msg.rid, gen=msg.gen, stage=failed.stage, text=failed.args[0]),
            )
            return
        if msg.rid in self._finished:
            fail("request", f"request id {msg.rid!r} was already used with this prefill rank")
            return
        if down.error is not None:  # the handshake failed: both sides report its text
            self._to_down(
                down.ident,
                wire.Fail(rid=msg.rid, gen=msg.gen, stage=down.error[0], text=down.error[1]),
            )
            return
        if msg.dst_rank != down.hello.tp_rank or msg.dst_size != down.hello.tp_size:
            fail(
                "request",
                f"decode rank {down.hello.tp_rank} sent a request as rank "
                f"{msg.dst_rank}/{msg.dst_size}",
            )
            return
        rec = self._send_rec(msg.rid)
        if msg.dst_rank in rec.dsts:
            fail("request", f"decode rank {msg.dst_rank} sent request {msg.rid!r} twice")
            return
        if rec.dst_size is not None and rec.dst_size != msg.dst_size:
            fail(
                "request",
                f"decode ranks disagree on their TP size ({rec.dst_size} and {msg.dst_size})",
            )
            return
        assert down.plan is not None
        if msg.needed == down.plan.empty:
            fail(
                "plan",
                f"the plans disagree: decode rank {msg.dst_rank} says it "
                f"{'needs' if msg.needed else 'does not need'} this source",
            )
            return
        rec.dst_size = msg.dst_size
        dst = rec.dsts[msg.dst_rank] = _Dst(down, msg)
        for slots, last in rec.chunks:
            if rec.error is None:
                self._write_chunk(rec, dst, slots, last)
        self._check_send(rec)

    def _on_offer(self, handle: Send) -> None:
        rid = handle.request_id
        early = self._early.pop(rid, None)
        if early is not None or rid in self._finished:
            handle._fail(
                early
                or RequestError(
                    f"request {rid!r} already finished here", stage="request", request_id=rid
                )
            )
            self._finish(rid)
            return
        rec = self._send_rec(rid)
        rec.handle = handle
        rec.deadline = time.monotonic() + self.request_timeout_s
        if rec.dsts:
            handle._move(State.WAITING)
        self._check_send(rec)

    def _on_write(self, handle: Send, slots: dict[str, np.ndarray], last: bool) -> None:
        rec = self._sends.get(handle.request_id)
        if rec is None or rec.handle is not handle or rec.error is not None:
            return
        rec.chunks.append((slots, last))
        rec.last = last
        for dst in rec.dsts.values():
            self._write_chunk(rec, dst, slots, last)
            if rec.error is not None:
                return
        self._check_send(rec)

    def _write_chunk(
        self, rec: _SendRec, dst: _Dst, slots: dict[str, np.ndarray], last: bool
    ) -> None:
        request: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for pool, src in slots.items():
            have = dst.slots.get(pool)
            at = dst.cursor.get(pool, 0)
            if have is None or at + src.size > have.size:
                room = 0 if have is None else have.size - at
                self._fail_send(
                    rec,
                    "plan",
                    f"a chunk names {src.size} slots of pool {pool!r} but "
                    f"{dst.down.where()} has {room} destination slots left",
                )
                return
            request[pool] = (src, have[at : at + src.size])
            dst.cursor[pool] = at + src.size
        if last:
            short = [p for p, s in dst.slots.items() if dst.cursor[p] != s.size]
            if short:
                p = short[0]
                self._fail_send(
                    rec,
                    "plan",
                    f"the last chunk leaves {dst.slots[p].size - dst.cursor[p]} "
                    f"destination slots of pool {p!r} of {dst.down.where()} unwritten",
                )
                return
            dst.last = True
        if not dst.needed:
            return
        assert dst.down.plan is not None and dst.down.peer is not None
        try:
            descs = dst.down.plan.expand(request)
        except PlanError as exc:
            self._fail_send(rec, "plan", f"slots named by {dst.down.where()}: {exc}")
            return
        if len(descs) == 0 and not last:
            return
        tag = wire.Tag(rec.rid, dst.gen, self.manifest.tp_rank, dst.seq, dst.seq + 1 if last else 0)
        dst.seq += 1
        left = max(rec.deadline - time.monotonic(), 0.001)
        try:
            transfer = self.backend.write(
                dst.down.peer, descs, wire.encode(tag) if self._notifying else None, timeout=left
            )
        except XferError as exc:
            self._fail_send(rec, "transfer", f"writing to {dst.down.where()}: {exc}")
            return
        dst.transfers.append((transfer, tag))
        if rec.handle is not None:
            rec.handle._move(State.TRANSFERRING)

    def _poll_transfers(self) -> None:
        for rec in list(self._sends.values()):
            if rec.error is not None:
                continue
            for dst in rec.dsts.values():
                for i, (t, tag) in enumerate(dst.transfers):
                    if tag is None:
                        continue
                    st = t.poll()
                    if st is Status.FAILED:
                        self._fail_send(rec, "transfer", str(t.error))
                        break
                    if st is Status.DONE:
                        if not self._notifying:
                            self._to_down(
                                dst.down.ident,
                                wire.Written(
                                    rid=tag.rid,
                                    gen=tag.gen,
                                    src_rank=tag.src_rank,
                                    seq=tag.seq,
                                    total=tag.total,
                                ),
                            )
                        dst.transfers[i] = (t, None)
                if rec.error is not None:
                    break
            if rec.error is None:
                self._check_send(rec)

    def _check_send(self, rec: _SendRec) -> None:
        if rec.error is not None or rec.handle is None or not rec.last or rec.dst_size is None:
            return
        if len(rec.dsts) < rec.dst_size:
            return
        for dst in rec.dsts.values():
            if not dst.last or any(tag is not None for _, tag in dst.transfers):
                return
        self._done(rec, self._sends)

    def _fail_send(
        self,
        rec: _SendRec,
        stage: str,
        detail: str,
        *,
        formatted: bool = False,
        ack: _Down | None = None,
        gone: _Down | None = None,
    ) -> None:
        """End ``rec``'s writes (drained), then report the root cause to the engine and every
        decode rank of the request (``ack`` gets an ``AbortAck`` instead, ``gone`` nothing)."""
        if rec.error is not None:
            return
        where = f"prefill rank {self.manifest.tp_rank} ({self.address})"
        text = detail if formatted else _stage_text(rec.rid, stage, where, detail)
        rec.error = RequestError(text, stage=stage, request_id=rec.rid)
        for dst in rec.dsts.values():
            for t, _ in dst.transfers:
                try:
                    t.abort(text, timeout=DRAIN_S)
                except XferError as exc:
                    log.error("%s: %s", self.address, exc)
        for dst in rec.dsts.values():
            if dst.down is gone or self._downs.get(dst.down.ident) is not dst.down:
                continue
            if dst.down is ack:
                self._to_down(dst.down.ident, wire.AbortAck(rid=rec.rid, gen=dst.gen))
            else:
                self._to_down(
                    dst.down.ident, wire.Fail(rid=rec.rid, gen=dst.gen, stage=stage, text=text)
                )
        del self._sends[rec.rid]
        self._failed[rec.rid] = rec.error
        while len(self._failed) > REMEMBERED:
            self._failed.popitem(last=False)
        if rec.handle is not None:
            rec.handle._fail(rec.error)
            self._finish(rec.rid)
        else:  # not offered yet: offer() will report it
            self._early[rec.rid] = rec.error
            while len(self._early) > REMEMBERED:
                self._early.popitem(last=False)

    def _on_remote_fail(self, down: _Down, msg: wire.Abort | wire.Fail) -> None:
        rec = self._sends.get(msg.rid)
        dst = None if rec is None else rec.dsts.get(down.hello.tp_rank)
        if rec is None or (dst is not None and dst.gen != msg.gen):
            if msg.rid not in self._finished and msg.rid not in self._early:
                err = RequestError(
                    msg.text, stage=msg.stage, request_id=msg.rid, peer=down.hello.address
                )
                self._early[msg.rid] = err  # offer() after this reports it
            else:
                log.info(
                    "%s: late %s for request %r: dropped", self.address, type(msg).__name__, msg.rid
                )
            if isinstance(msg, wire.Abort):
                self._to_down(down.ident, wire.AbortAck(rid=msg.rid, gen=msg.gen))
            return
        assert rec is not None
        if isinstance(msg, wire.Abort):
            if dst is None:  # we never wrote for it: nothing in flight
                self._to_down(down.ident, wire.AbortAck(rid=msg.rid, gen=msg.gen))
            self._fail_send(rec, msg.stage, msg.text, formatted=True, ack=down)
        else:
            self._fail_send(rec, msg.stage, msg.text, formatted=True, gone=down)

    def _lose_down(self, down: _Down, why: str) -> None:
        hit = any(d.down is down for r in self._sends.values() for d in r.dsts.values())
        log.log(logging.WARNING if hit else logging.INFO, "%s: %s", self.address, why)
        if self._downs.get(down.ident) is down:
            del self._downs[down.ident]
        for rec in list(self._sends.values()):
            if any(d.down is down for d in rec.dsts.values()):
                self._fail_send(rec, "peer lost", why, gone=down)
        if down.peer is not None:
            try:
                self.backend.disconnect(down.peer)
            except XferError as exc:
                log.warning("%s: disconnecting %s: %s", self.address, down.where(), exc)

    # == both sides ===================================================================

    def _on_abort(self, handle: _Handle) -> None:
        rid = handle.request_id
        if isinstance(handle, Receive):
            rec = self._recvs.get(rid)
            if rec is not None and rec.handle is handle:
                self._fail_recv(rec, "abort", "aborted by the engine", None)
            return
        srec = self._sends.get(rid)
        if srec is not None and srec.handle is handle:
            self._fail_send(srec, "abort", "aborted by the engine")

    def _tick(self, now: float) -> None:
        for up in list(self._ups.values()):
            if not up.ready:
                if now - up.hello_at > self.handshake_timeout_s:
                    self._lose_up(
                        up,
                        f"no handshake reply from {up.address} within {self.handshake_timeout_s} s "
                        "(not running, unreachable, or refusing our key)",
                        stage="handshake",
                    )
                continue
            if now - up.last_seen > self.dead_after_s:
                self._lose_up(
                    up,
                    f"{up.where()} sent nothing for {now - up.last_seen:.1f} s "
                    f"(dead_after_s={self.dead_after_s})",
                )
            elif now - up.last_ping >= self.heartbeat_s:
                up.last_ping = now
                assert up.welcome is not None
                self._to_up(up, wire.Ping(incarnation=self.incarnation))
        for down in list(self._downs.values()):
            if now - down.last_seen > self.dead_after_s:
                self._lose_down(
                    down,
                    f"{down.where()} sent nothing for {now - down.last_seen:.1f} s "
                    f"(dead_after_s={self.dead_after_s})",
                )
        for rec in list(self._recvs.values()):
            if rec.error is None and now > rec.deadline:
                self._fail_recv(
                    rec,
                    "timeout",
                    f"not done within request_timeout_s={self.request_timeout_s}",
                    None,
                )
            elif rec.error is not None and now > rec.drain_at + self.dead_after_s:
                log.warning(
                    "%s: request %r: no abort confirmation from %s",
                    self.address,
                    rec.rid,
                    sorted(rec.acks),
                )
                rec.acks.clear()
                self._settle_recv(rec)
        for srec in list(self._sends.values()):
            if srec.error is None and now > srec.deadline:
                self._fail_send(
                    srec, "timeout", f"not done within request_timeout_s={self.request_timeout_s}"
                )

    def _shutdown(self, stage: str, why: str) -> None:
        for rec in list(self._recvs.values()):
            if rec.error is None:
                self._fail_recv(rec, stage, why, None)
            rec.acks.clear()  # we cannot wait: our memory is about to be released
            self._settle_recv(rec)
        for srec in list(self._sends.values()):
            self._fail_send(srec, stage, why)
        bye = wire.Bye(incarnation=self.incarnation, reason=why)
        for up in list(self._ups.values()):
            self._to_up(up, bye)
        for down in list(self._downs.values()):
            self._to_down(down.ident, bye)
        time.sleep(0.05)  # let the byes leave before the sockets close (linger is 0)
        for up in list(self._ups.values()):
            self._drop_up(up)
