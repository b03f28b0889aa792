"""A hostile peer speaking the Session's wire protocol by hand, over real ZMQ sockets.

Every raw message the hostile tests send is built here, from
``xferkit.session.wire``'s Structs and ``wire.encode``, so a protocol change
(a version bump, packed Request slots, new Hello fields) is adapted in one
place. An ``Attacker`` owns a real loopback backend (its endpoint is valid,
so a handshake succeeds) and opens connections: ``connect`` a DEALER to a
Session, posing as a decode rank or group member (``Conn``), or ``listen`` on
a ROUTER, posing as a prefill rank (``Listener``). Nothing here knows what
the Session should do with what it is sent: the tests say that.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import msgspec
import zmq

import xferkit as xk
from xferkit.session import fingerprint, wire

M = TypeVar("M", bound=wire.Message)

WAIT_S = 5.0
"""How long a receive waits by default: every wait in the hostile tests is bounded."""


def introduction(
    manifest: xk.Manifest, backend: xk.Backend | None, address: str, incarnation: int
) -> dict[str, Any]:
    """The fields a Hello or a Welcome carries for this manifest and backend."""
    return {
        "version": wire.PROTOCOL_VERSION,
        "incarnation": incarnation,
        "address": address,
        "tp_rank": manifest.tp_rank,
        "tp_size": manifest.tp_size,
        "fingerprint": fingerprint(manifest),
        "manifest": manifest.encode(),
        "backend": "loopback" if backend is None else backend.name,
        "endpoint": b"" if backend is None else backend.endpoint(),
        "driver_address": "" if backend is None else str(backend.driver.address),
    }


def envelope(endpoint: bytes) -> dict[str, Any]:
    """A backend endpoint opened up: the core's envelope (backend, contract, host, pid,
    address, generation) with the driver's blob decoded as a map under ``blob``."""
    env = msgspec.msgpack.decode(endpoint)
    assert isinstance(env, dict), env
    return env


def forge_endpoint(
    endpoint: bytes, *, blob: Mapping[str, Any] | None = None, **fields: Any
) -> bytes:
    """``endpoint`` with envelope ``fields`` and driver ``blob`` fields replaced."""
    env = envelope(endpoint)
    env.update(fields)
    if blob:
        env["blob"] = {**env["blob"], **blob}
    return msgspec.msgpack.encode(env)


def distinct_endpoint(endpoint: bytes) -> tuple[bytes, str]:
    """A valid-looking loopback endpoint of the same process and memory under a fresh driver
    id, and its driver address: what a peer with many loopback backends would send."""
    env = envelope(endpoint)
    new = uuid.uuid4().hex[:16]
    address = f"{env['blob']['pid']}:{new}"
    return forge_endpoint(endpoint, address=address, blob={"id": new}), address


def _deadline(timeout: float) -> float:
    return time.monotonic() + timeout


class _Socket:
    """One ZMQ socket of the attacker, with bounded receives."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock

    def _recv(self, deadline: float) -> list[bytes] | None:
        left = deadline - time.monotonic()
        if left <= 0 or not self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
            return None
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)


class Conn(_Socket):
    """A DEALER connected to a Session's address: the attacker as a decode rank or member."""

    def __init__(self, attacker: Attacker, sock: zmq.Socket[Any], address: str) -> None:
        super().__init__(sock)
        self.attacker = attacker
        self.address = address

    # -- raw ----------------------------------------------------------------------

    def send(self, msg: wire.Message) -> None:
        self.sock.send(wire.encode(msg))

    def flood(self, messages: Iterable[wire.Message]) -> int:
        """Send every message back to back; how many were sent."""
        n = 0
        for msg in messages:
            self.send(msg)
            n += 1
        return n

    def next(self, kind: type[M], timeout: float = WAIT_S) -> M | None:
        """The next message of type ``kind`` (others skipped), None after ``timeout``."""
        limit = _deadline(timeout)
        while (frames := self._recv(limit)) is not None:
            msg = wire.decode(frames[-1])
            if isinstance(msg, kind):
                return msg
        return None

    # -- as a decode rank -------------------------------------------------------------

    def hello(self, timeout: float = WAIT_S, **changes: Any) -> wire.Welcome | None:
        """Say Hello (the attacker's own introduction, ``changes`` replacing fields); the
        Welcome, or None when none came within ``timeout``."""
        fields = {**self.attacker.introduction(), **changes}
        self.send(wire.Hello(**fields))
        return self.next(wire.Welcome, timeout)

    def request(
        self, rid: str, slots: Mapping[str, Sequence[int]], gen: int = 1, **changes: Any
    ) -> None:
        """Claim request ``rid`` as decode rank 0 of 1, naming ``slots`` (registration: the
        attacker's backend's, as an honest rank sends it)."""
        backend = self.attacker.backend
        fields: dict[str, Any] = {
            "rid": rid,
            "gen": gen,
            "needed": True,
            "slots": wire.pack_slots(slots),
            "registration": 0 if backend is None else backend.generation,
        }
        fields.update(changes)
        self.send(wire.Request(**fields))

    def abort(self, rid: str, gen: int = 1, text: str = "forged by the attacker") -> None:
        self.send(wire.Abort(rid=rid, gen=gen, stage="abort", text=text))

    def fail(self, rid: str, gen: int = 1, text: str = "forged by the attacker") -> None:
        self.send(wire.Fail(rid=rid, gen=gen, stage="transfer", text=text))

    def unpacked(self, rid: str, gen: int = 1, chunk: int = 0, index: int = 0) -> None:
        self.send(wire.Unpacked(rid=rid, gen=gen, chunk=chunk, index=index))

    def renew(self, rids: list[str]) -> None:
        self.send(wire.Renew(rids=rids))

    def ping(self) -> None:
        self.send(wire.Ping(incarnation=self.attacker.incarnation))

    def sync(self, timeout: float = WAIT_S) -> bool:
        """Ping and wait for the Pong: True once the Session has handled everything this
        connection sent before (it handles a connection's messages in order)."""
        self.ping()
        return self.next(wire.Pong, timeout) is not None

    # -- as a group member / roster client ------------------------------------------

    def join(
        self,
        tp_rank: int,
        tp_size: int,
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        address: str = "tcp://127.0.0.1:9|impostor",
        timeout: float = WAIT_S,
    ) -> wire.Joined | None:
        msg = wire.Join(
            incarnation=self.attacker.incarnation,
            address=address,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )
        self.send(msg)
        return self.next(wire.Joined, timeout)

    def lookup(self, timeout: float = WAIT_S) -> wire.Roster | None:
        self.send(wire.Lookup())
        return self.next(wire.Roster, timeout)


class Listener(_Socket):
    """A bound ROUTER: the attacker posing as a prefill rank a decode rank pairs with."""

    def __init__(self, attacker: Attacker, sock: zmq.Socket[Any]) -> None:
        super().__init__(sock)
        self.attacker = attacker
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, ident: bytes, msg: wire.Message) -> None:
        self.sock.send_multipart([ident, wire.encode(msg)])

    def next(self, kind: type[M], timeout: float = WAIT_S) -> tuple[bytes, M] | None:
        """The next message of type ``kind`` with its sender's identity, None after
        ``timeout`` (others, heartbeats among them, skipped)."""
        limit = _deadline(timeout)
        while (frames := self._recv(limit)) is not None:
            ident, data = frames[0], frames[-1]
            msg = wire.decode(data)
            if isinstance(msg, kind):
                return ident, msg
        return None

    def welcome(self, ident: bytes, **changes: Any) -> None:
        """Answer a Hello as a prefill rank (the attacker's introduction, ``changes``
        replacing fields)."""
        self.send(ident, wire.Welcome(**{**self.attacker.introduction(), **changes}))

    def fail(self, ident: bytes, rid: str, gen: int, text: str = "forged by the attacker") -> None:
        self.send(ident, wire.Fail(rid=rid, gen=gen, stage="transfer", text=text))

    def abort_ack(self, ident: bytes, rid: str, gen: int) -> None:
        self.send(ident, wire.AbortAck(rid=rid, gen=gen))

    def written(self, ident: bytes, rid: str, gen: int, seq: int = 0, total: int = 1) -> None:
        self.send(ident, wire.Written(rid=rid, gen=gen, src_rank=0, seq=seq, total=total))

    def pong(self, ident: bytes) -> None:
        self.send(ident, wire.Pong(incarnation=self.attacker.incarnation))


class Attacker:
    """A hostile peer: a real loopback backend (registered with ``manifest``, when given, so
    its endpoint is valid) and a ZMQ context for its connections; ``memory`` is whatever
    keeps the manifest's buffers alive (a ``Reference``)."""

    def __init__(
        self, manifest: xk.Manifest, *, memory: object = None, register: bool = True
    ) -> None:
        self.manifest = manifest
        self.memory = memory
        self.incarnation = random.getrandbits(62)
        self.name = f"tcp://attacker-{os.getpid()}"
        self.backend: xk.Backend | None = None
        if register:
            self.backend = xk.open_backend("loopback")
            self.backend.register(manifest)
        self.ctx = zmq.Context()
        self._socks: list[_Socket] = []

    def introduction(self) -> dict[str, Any]:
        return introduction(self.manifest, self.backend, self.name, self.incarnation)

    def connect(self, address: str) -> Conn:
        """A DEALER to a Session's address (its Curve key part, if any, is not used)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address.partition("|")[0])
        conn = Conn(self, sock, address)
        self._socks.append(conn)
        return conn

    def listen(self) -> Listener:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        listener = Listener(self, sock)
        self._socks.append(listener)
        return listener

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()
        self.ctx.term()
        if self.backend is not None:
            self.backend.close()

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def hostile(side: str = "dst") -> Iterator[Attacker]:
    """A hostile peer with a decode rank's layout (``side="dst"``) or a prefill rank's, and a
    valid loopback endpoint."""
    from session_rank import reference

    ref = reference(1, 1, seed=99)
    rank = (ref.dsts if side == "dst" else ref.srcs)[0]
    with Attacker(rank.manifest, memory=ref) as a:
        yield a
