"""An agent's own TCP sockets, found from /proc, so that a fence can silence them first.

Destroying a NIXL agent joins its UCX progress thread, and that thread stops only
once a round of UCX progress finds nothing to do: while a peer streams writes into
the agent (UCX_TLS=tcp), it keeps receiving them, and the destruction waits for the
stream to pause, holding the GIL: measured 40 to 200 ms here (every Python thread of
the process stopped as long), every byte of 32 MiB posted before the fence landing
meanwhile, a second under strace.
Attaching a socket filter that drops every packet to the agent's listeners and
connections first silences every stream at once: the thread drains what the
kernel already queued and stops, nothing new arrives, and a sender's reconnection
gets no answer. Shutting the sockets down instead does not do: UCX then fails an
``accept`` on the listener, leaks its async handler, and the process's next agent
cannot be created (``Element already exists``).

The sockets are told apart from the rest of the process's without any UCX or
NIXL call: an agent's listeners are the listening sockets that appeared while it
was created whose port its metadata names (the UCX worker address packs it
big-endian); its connections are the sockets in the epoll sets that appeared
while it was created, holding no listener and holding a connection to or from
one of those ports (the worker's own set; the UCX async thread's set holds
listeners). Anything that does not fit is left alone: the destruction still
fences, only later.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import NamedTuple

Fds = dict[int, str]
"""A process's descriptors: number -> what ``/proc/self/fd`` links it to (``socket:[ino]``)."""

creating = threading.Lock()
"""Held around an agent's creation and the snapshots taken either side of it."""

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)
_DROP = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("=HBBI", 0x06, 0, 0, 0))
"""A classic BPF program of one instruction, ``ret #0`` (BPF_RET | BPF_K): keep no byte of
any packet. The kernel copies it when attached; it lives as long as the module anyway."""
_PROGRAM = struct.pack("@HP", 1, ctypes.addressof(_DROP))  # struct sock_fprog {len, filter}


def snapshot() -> Fds:
    """This process's open descriptors (empty where ``/proc`` cannot tell)."""
    out: Fds = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


class Owned(NamedTuple):
    """What an agent opened while it was created: (descriptor, link) pairs."""

    listeners: list[tuple[int, str]]
    epolls: list[tuple[int, str]]

    @property
    def ports(self) -> set[int]:
        return {port for fd, link in self.listeners if (port := _port(fd, link)) is not None}


def owned(before: Fds, after: Fds, metadata: bytes) -> Owned:
    """The listeners and epoll sets among the descriptors that appeared between ``before`` and
    ``after`` (an agent's creation), the listeners kept only where ``metadata`` names their port
    (big-endian, as UCX packs it)."""
    new = [(fd, link) for fd, link in after.items() if before.get(fd) != link]
    listeners = []
    for fd, link in new:
        with _socket(fd, link) as sock:
            port = sock.getsockname()[1] if sock is not None and _listening(sock) else None
        if port is not None and struct.pack(">H", port) in metadata:
            listeners.append((fd, link))
    epolls = [(fd, link) for fd, link in new if link == "anon_inode:[eventpoll]"]
    return Owned(listeners, epolls)


Silenced = list[tuple[int, str]]


def silence(agent: Owned) -> Silenced:
    """Drop every packet reaching ``agent``'s listeners, then its connections, from now on;
    the sockets that was done to. TCP treats what is dropped as lost: it resends it until
    the connection ends, so ``unsilence`` loses nothing."""
    ports, done = agent.ports, Silenced()
    if not ports:
        return done
    for fd, link in agent.listeners:
        done += _drop_all(fd, link)
    for fd, link in agent.epolls:
        if _readlink(fd) != link:  # closed since, its number reused
            continue
        members = [(m, ml) for m in _members(fd) if (ml := _readlink(m)).startswith("socket:")]
        kinds = [_kind(m, ml, ports) for m, ml in members]
        if "listener" in kinds or "ours" not in kinds:  # the async thread's set, or not UCX's
            continue
        for (m, ml), kind in zip(members, kinds, strict=True):
            if kind != "gone":
                done += _drop_all(m, ml)
    return done


def unsilence(silenced: Silenced) -> None:
    """Let packets through again to sockets ``silence`` silenced (those still open)."""
    for fd, link in silenced:
        with _socket(fd, link) as sock, contextlib.suppress(OSError):
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)


# -- helpers ------------------------------------------------------------------------


def _readlink(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _members(epoll: int) -> list[int]:
    """The descriptors an epoll set watches (``tfd:`` lines of its fdinfo)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll}") as info:
            return [int(line.split()[1]) for line in info if line.startswith("tfd:")]
    except (OSError, ValueError, IndexError):
        return []


@contextlib.contextmanager
def _socket(fd: int, link: str) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` as a TCP socket, if it still is the one ``link`` names."""
    if not link.startswith("socket:"):
        yield None
        return
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket any more: the number was reused
        os.close(dup)
        yield None
        return
    try:
        same = f"socket:[{os.fstat(dup).st_ino}]" == link
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        yield sock if same and tcp else None
    finally:
        sock.close()


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _port(fd: int, link: str) -> int | None:
    with _socket(fd, link) as sock:
        return None if sock is None else int(sock.getsockname()[1])


def _kind(fd: int, link: str, ports: set[int]) -> str:
    """``listener``, ``ours`` (a connection to or from one of ``ports``), ``connection``, or
    ``gone`` (no longer the TCP socket listed)."""
    with _socket(fd, link) as sock:
        if sock is None:
            return "gone"
        if _listening(sock):
            return "listener"
        try:
            mine, theirs = sock.getsockname()[1], sock.getpeername()[1]
        except OSError:
            return "connection"
        return "ours" if mine in ports or theirs in ports else "connection"


def _drop_all(fd: int, link: str) -> Silenced:
    with _socket(fd, link) as sock:
        if sock is None:
            return []
        try:  # set on the socket itself, not only on this duplicate
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, _PROGRAM)
        except OSError:
            return []
        return [(fd, link)]
