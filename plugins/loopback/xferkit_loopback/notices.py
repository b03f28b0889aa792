"""Notifications between loopback drivers: datagrams on abstract unix sockets, a bounded inbox.

Sent only after the data (by the sender's worker). On the receiving side a
thread moves arrivals into an inbox, so a receiver that drains late loses
nothing and fails no sender, up to ``MAX_QUEUED``; an eventfd is readable
while the inbox may hold some, for event loops that would rather sleep.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from collections import deque

import msgspec

MAX_QUEUED = 1 << 16
"""Notifications a receiver holds undrained; past it senders wait, then fail saying so."""
NOTIFY_WAIT_S = 10.0
"""How long a sender waits for room in a full receiver before its write fails."""


def socket_name(backend_id: str) -> bytes:
    return b"\0xferkit-loopback-" + backend_id.encode()


class Mailbox:
    """One driver's socket: what it sends, and what arrived for it."""

    def __init__(self, backend_id: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_name(backend_id))
        self.sock.settimeout(0.05)  # the receiver wakes to notice close()
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)  # readable while the inbox may hold some
        self.closing = threading.Event()
        self._receiver = threading.Thread(
            target=_receive,
            args=(weakref.ref(self), self.sock, self.inbox, self.fd, self.closing),
            name=f"xferkit-loopback-{backend_id}-rx",
            daemon=True,
        )
        self._receiver.start()

    def send(self, sender: str, message: bytes, to: str, where: bytes) -> str | None:
        """Deliver ``message`` from ``sender`` to peer ``to`` at socket ``where``; why not, or None.

        A full receiver makes the sender wait (bounded), never drop.
        """
        data = msgspec.msgpack.encode((sender, message))
        deadline = time.monotonic() + NOTIFY_WAIT_S
        while not self.closing.is_set():
            try:
                self.sock.sendto(data, where)  # blocks up to the socket timeout
                return None
            except TimeoutError:
                if time.monotonic() > deadline:
                    return (
                        f"data written, but peer loopback:{to} holds {MAX_QUEUED} undrained "
                        f"notifications and took none for {NOTIFY_WAIT_S} s"
                    )
            except OSError as exc:
                return f"data written, but the notification to {to} failed: {exc}"
        return "data written, but the backend closed before the notification went out"

    def drain(self) -> list[tuple[str, bytes]]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)  # cleared first: a later arrival sets it again
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        return out

    def close(self) -> None:
        self.closing.set()
        self._receiver.join(timeout=10)
        self.sock.close()
        os.close(self.fd)


def _receive(
    owner: weakref.ref[Mailbox],
    sock: socket.socket,
    inbox: deque[tuple[str, bytes]],
    fd: int,
    closing: threading.Event,
) -> None:
    """Move arriving notifications into the inbox; stop taking them while it is full."""
    while not closing.is_set() and owner() is not None:
        if len(inbox) >= MAX_QUEUED:
            closing.wait(0.01)  # the kernel queue fills next; senders wait, then fail
            continue
        try:
            data = sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:
            return
        try:
            inbox.append(msgspec.msgpack.decode(data, type=tuple[str, bytes]))
        except msgspec.DecodeError:
            continue  # anyone on this machine can send here: never let it cost good ones
        with contextlib.suppress(OSError):  # closed under us at shutdown
            os.eventfd_write(fd, 1)
