"""Notifications between loopback drivers: datagrams on abstract unix sockets, a bounded inbox.

Sent only after the data (by the sender's worker). A receiver sleeping on
``fd`` (an epoll set over the socket and an eventfd) is woken by the datagram
itself and takes it straight off the socket: one wake-up per notification.
The kernel queues only a few datagrams per socket (net.unix.max_dgram_qlen),
so a receiver that drains late would block its senders: a sender that finds
the queue full pokes the receiver's thread (on a second socket, idle
otherwise), which moves the queue into an inbox, so nothing is lost and no
sender fails, up to ``MAX_QUEUED``. Datagrams are taken under one lock,
inbox first, so arrival order is kept.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import weakref
from collections import deque

import msgspec

from xferkit.driver import name_thread

MAX_QUEUED = 1 << 16
"""Notifications a receiver holds undrained; past it senders wait, then fail saying so."""
NOTIFY_WAIT_S = 10.0
"""How long a sender waits for room in a full receiver before its write fails."""
_MAX_DATAGRAM = 1 << 20

_Note = tuple[str, bytes]
_decode = msgspec.msgpack.Decoder(_Note).decode
_encode = msgspec.msgpack.Encoder().encode


def socket_name(backend_id: str) -> bytes:
    return b"\0xferkit-loopback-" + backend_id.encode()


def poke_name(backend_id: str) -> bytes:
    """Where a sender pokes a receiver whose queue is full (see the module docstring)."""
    return b"\0xferkit-loopback-poke-" + backend_id.encode()


def unreachable(where: bytes) -> str | None:
    """Why socket ``where`` cannot be sent to from here, or None: asked at connect, so that
    a peer whose notifications would fail is refused before any byte is written."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(where)  # a datagram connect sends nothing; it finds the socket
        except OSError as exc:
            return str(exc)
    return None


def _bound(name: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(name)
    sock.setblocking(False)
    return sock


class _Inbox:
    """What arrived: the socket's queue and the inbox behind it, taken from under one lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.notes: deque[_Note] = deque()
        self.lock = threading.Lock()
        self.efd = os.eventfd(0, os.EFD_NONBLOCK)  # readable while the inbox may hold some
        self.raised = False  # whether efd is set (both change under lock only)
        self._buf = bytearray(_MAX_DATAGRAM)
        self._view = memoryview(self._buf)
        self._ready = select.poll()  # asked before each receive: no exception ends a drain
        self._ready.register(sock.fileno(), select.POLLIN)

    def take(self, into: deque[_Note] | list[_Note], limit: int) -> int:
        """Move up to ``limit`` waiting datagrams off the socket (call under ``lock``)."""
        moved = 0
        while moved < limit and self._ready.poll(0):
            try:
                size = self.sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # closed under us at shutdown
                break
            try:
                into.append(_decode(self._view[:size]))
            except msgspec.DecodeError:
                continue  # anyone on this machine can send here: never let it cost good ones
            moved += 1
        return moved


class Mailbox:
    """One driver's sockets: what it sends, and what arrived for it."""

    def __init__(self, backend_id: str) -> None:
        self.sock = _bound(socket_name(backend_id))
        self._poke_at = poke_name(backend_id)
        self._pokes = _bound(self._poke_at)
        self._box = _Inbox(self.sock)
        self._epoll = select.epoll()
        self._epoll.register(self.sock.fileno(), select.EPOLLIN)
        self._epoll.register(self._box.efd, select.EPOLLIN)
        self.fd = self._epoll.fileno()
        """Readable while a notification may be waiting (on the socket or in the inbox)."""
        self.closing = threading.Event()
        self._receiver = threading.Thread(
            target=_receive,
            args=(weakref.ref(self), self._box, self._pokes, self.closing),
            name=f"xferkit-loopback-{backend_id}-rx",
            daemon=True,
        )
        self._receiver.start()

    def send(self, sender: str, message: bytes, to: str, where: bytes, poke: bytes) -> str | None:
        """Deliver ``message`` from ``sender`` to peer ``to`` at socket ``where`` (its thread at
        ``poke``); why not, or None.

        A full receiver makes the sender wait (bounded), never drop.
        """
        data = _encode((sender, message))
        deadline = 0.0
        nap = 2e-5
        while not self.closing.is_set():
            try:
                self.sock.sendto(data, where)
                return None
            except BlockingIOError:  # its queue is full: have its thread make room
                now = time.monotonic()
                if not deadline:
                    deadline = now + NOTIFY_WAIT_S
                elif now > deadline:
                    return (
                        f"data written, but peer loopback:{to} holds {MAX_QUEUED} undrained "
                        f"notifications and took none for {NOTIFY_WAIT_S} s"
                    )
                with contextlib.suppress(OSError):  # full of pokes already: it is awake
                    self.sock.sendto(b"", poke)
                self.closing.wait(nap)
                nap = min(nap * 2, 2e-3)
            except OSError as exc:
                return f"data written, but the notification to {to} failed: {exc}"
        return "data written, but the backend closed before the notification went out"

    def drain(self) -> list[_Note]:
        box = self._box
        with box.lock:
            if box.raised:
                box.raised = False
                os.eventfd_read(box.efd)
            out = list(box.notes)
            box.notes.clear()
            box.take(out, MAX_QUEUED)
        return out

    def close(self) -> None:
        self.closing.set()
        with contextlib.suppress(OSError):
            self.sock.sendto(b"", self._poke_at)  # wake the thread to see it
        self._receiver.join(timeout=10)
        self._epoll.close()
        self.sock.close()
        self._pokes.close()
        os.close(self._box.efd)


def _receive(
    owner: weakref.ref[Mailbox], box: _Inbox, pokes: socket.socket, closing: threading.Event
) -> None:
    """Move the socket's queue into the inbox each time a sender found it full."""
    name_thread("xk-loopback-rx")
    poller = select.poll()
    poller.register(pokes.fileno(), select.POLLIN)
    while not closing.is_set() and owner() is not None:
        try:
            if not poller.poll(500):  # a dropped (unclosed) mailbox is noticed in time
                continue
            while True:  # every poke so far is answered by this pass
                pokes.recv(16)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return
        with box.lock, contextlib.suppress(OSError):  # OSError: closed under us at shutdown
            if box.take(box.notes, MAX_QUEUED - len(box.notes)) and not box.raised:
                os.eventfd_write(box.efd, 1)
                box.raised = True
