"""How the shell's ZMQ sockets are made: limits on every socket, CurveZMQ on both ends, and
the ZAP callback that trusts only the configured keys."""

from __future__ import annotations

from typing import Any, cast

import zmq
import zmq.auth.thread
import zmq.utils.monitor

from ..errors import XferError
from . import wire
from .core import log
from .keys import KEY_LEN, SessionKeys

HWM = 100_000
"""ZMQ high-water mark of every socket: messages queued before a send would block."""
MONITORED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED
"""What a DEALER's monitor reports: a refused Curve key, a peer whose connection closed."""


def monitor_events(mon: zmq.Socket[Any]) -> list[int]:
    """The events waiting on a socket monitor."""
    events = []
    while True:
        try:
            events.append(int(zmq.utils.monitor.recv_monitor_message(mon, zmq.NOBLOCK)["event"]))
        except zmq.ZMQError:
            return events


_POLLIN = int(zmq.POLLIN)  # a plain int: ``&`` with the enum member builds a flag each time


def waiting(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (cheaper than a receive failing with EAGAIN, which
    costs an exception at the end of every drain)."""
    try:
        return bool(cast(int, sock.get(zmq.EVENTS)) & _POLLIN)
    except zmq.ZMQError:
        return True  # the receive says what is wrong


class Trust:
    """The ZAP callback: a client key is accepted only if trusted; refusals are logged."""

    def __init__(self, trusted: frozenset[bytes], name: str) -> None:
        self.trusted, self.name = trusted, name

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        log.warning("%s: refused a peer presenting untrusted Curve key %s", self.name, key.decode())
        return False


def limits(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)


def router(
    ctx: zmq.Context[Any], bind: str, keys: SessionKeys | None
) -> tuple[zmq.Socket[Any], zmq.auth.thread.ThreadAuthenticator | None]:
    """The bound ROUTER (a Curve server with keys) and its authenticator; ``XferError`` when
    ``bind`` cannot be bound (everything made is closed again)."""
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    limits(sock)
    if keys is not None:
        auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", Trust(keys.trusted, bind))
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    else:
        log.warning(
            "xferkit Session at %s runs without CurveZMQ keys: anyone who can reach it can "
            "name slots and trigger writes into this rank's memory (pass keys=SessionKeys)",
            bind,
        )
    try:
        sock.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise XferError(f"Session cannot bind {bind!r}: {exc}") from None
    return sock, auth


def check(address: str, keys: SessionKeys | None) -> str | None:
    """Why a session with ``keys`` cannot talk to ``address`` (keys on one side only, an
    untrusted key), or None."""
    _, _, key = address.partition("|")
    if keys is None and key:
        return (
            f"{address} has a Curve key, but this session has no keys: pass "
            "keys=SessionKeys(...) to talk to it"
        )
    if keys is not None and not key:
        return f"{address} has no Curve key, but this session has keys: both sides need them"
    if keys is not None and (len(key) != KEY_LEN or key.encode() not in keys.trusted):
        return f"{address}: its Curve key is not among the trusted keys"
    return None


def dealer(
    ctx: zmq.Context[Any], address: str, keys: SessionKeys | None, reconnect: tuple[float, float]
) -> zmq.Socket[Any] | str:
    """A DEALER connected to a session address (Curve client with keys), or why not."""
    if (problem := check(address, keys)) is not None:
        return problem
    endpoint, _, key = address.partition("|")
    sock = ctx.socket(zmq.DEALER)
    try:  # a socket left open would hang the context's term() at close
        limits(sock)
        low, high = reconnect
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(low * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(high * 1000)))
        if keys is not None:
            sock.curve_secretkey = keys.secret
            sock.curve_publickey = keys.public
            sock.curve_serverkey = key.encode()
        sock.connect(endpoint)
    except (zmq.ZMQError, ValueError) as exc:  # ValueError: text that cannot encode
        sock.close(linger=0)
        return f"cannot connect to {address!r}: {exc}"
    return sock
