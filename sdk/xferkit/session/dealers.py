"""The DEALER sockets the protocol core opens (to prefill ranks, group members, roster
lookups), each with a socket monitor that tells a refused Curve key or a closed peer, all
registered with the control thread's poller. Only the control thread touches them."""

from __future__ import annotations

import contextlib
from typing import Any

import zmq

from . import actions as act
from . import sockets
from .keys import SessionKeys


class Dealers:
    def __init__(
        self,
        ctx: zmq.Context[Any],
        poller: zmq.Poller,
        keys: SessionKeys | None,
        reconnect: tuple[float, float],
    ) -> None:
        self._ctx, self._poller, self._keys, self._reconnect = ctx, poller, keys, reconnect
        self.socks: dict[act.Conn, zmq.Socket[Any]] = {}
        self.conns: dict[zmq.Socket[Any], act.Conn] = {}  # each dealer's connection
        self.monitors: dict[zmq.Socket[Any], act.Conn] = {}

    def open(self, conn: act.Conn) -> str | None:
        """Connect ``conn``; why it cannot be, or None."""
        sock = sockets.dealer(self._ctx, conn[1], self._keys, self._reconnect)
        if isinstance(sock, str):
            return sock
        self.socks[conn] = sock
        self.conns[sock] = conn
        self._poller.register(sock, zmq.POLLIN)
        mon = sock.get_monitor_socket(sockets.MONITORED)
        self.monitors[mon] = conn
        self._poller.register(mon, zmq.POLLIN)
        return None

    def close(self, conn: act.Conn, linger_ms: int) -> None:
        sock = self.socks.pop(conn, None)
        if sock is None:
            return
        self.conns.pop(sock, None)
        for mon, c in list(self.monitors.items()):
            if c == conn:
                del self.monitors[mon]
                with contextlib.suppress(KeyError, zmq.ZMQError):
                    self._poller.unregister(mon)
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                mon.close(linger=0)
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(sock)
        sock.close(linger=linger_ms)

    def close_all(self) -> None:
        """Every socket, at once (the Session is ending)."""
        for sock in [*self.socks.values(), *self.monitors]:
            with contextlib.suppress(Exception):
                sock.close(linger=0)
        self.socks.clear()
        self.conns.clear()
        self.monitors.clear()
