"""One Mooncake TransferEngine: which protocol, how it starts, and how it stops quickly.

The engine runs without a metadata server (``P2PHANDSHAKE``): its segment name,
``host:rpc_port``, is all a peer needs to reach it. The port is random; Mooncake
cannot pin it in P2P mode without sharing the range with its TCP data port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator, Mapping

from mooncake.engine import TransferEngine

from xferkit.driver import INFINIBAND, OptionError

from .codes import check

log = logging.getLogger("xferkit.mooncake")

PROTOCOLS = ("rdma", "tcp")

STALL_TIMEOUT_S = 5
"""Default seconds without progress after which the TCP transport drops a transfer."""
ABANDON_AFTER_S = 86_400
"""What ``MC_TRANSFER_TIMEOUT`` is set to: the Python binding's own give-up, kept out of play.

When it fires, ``batch_transfer_sync*`` returns -1 and frees the batch while its
slices may still be moving bytes: a failure that is not one. Liveness comes from
the transport instead (TCP: ``stall_timeout``), whose failure means the slice ended."""

_PROGRESS = "MC_TCP_PROGRESS_TIMEOUT_SEC"
_ABANDON = "MC_TRANSFER_TIMEOUT"
_USER_STALL = os.environ.get(_PROGRESS)  # as the user set it, before any driver did


def default_stall_timeout() -> int:
    """``MC_TCP_PROGRESS_TIMEOUT_SEC`` as the user exported it, else ``STALL_TIMEOUT_S``."""
    if _USER_STALL is not None and _USER_STALL.isdigit() and 1 <= int(_USER_STALL) <= 3600:
        return int(_USER_STALL)
    return STALL_TIMEOUT_S


def configure(stall_timeout: int) -> None:
    """Set the engine's timeouts, which it reads from the process environment.

    The TCP transport reads ``MC_TCP_PROGRESS_TIMEOUT_SEC`` for every transfer it
    starts, so the value is process-wide: the last driver opened sets it for all.
    A variable is written only when it changes (``setenv`` racing the engine's
    ``getenv`` on another thread is unsafe when it grows the environment).
    """
    previous = os.environ.get(_PROGRESS)
    if previous != str(stall_timeout):
        if previous is not None and previous != _USER_STALL:
            log.info(
                "mooncake: stall_timeout %s s replaces %s s for every Mooncake engine in this "
                "process (MC_TCP_PROGRESS_TIMEOUT_SEC is process-wide)",
                stall_timeout,
                previous,
            )
        os.environ[_PROGRESS] = str(stall_timeout)
    if os.environ.get(_ABANDON) != str(ABANDON_AFTER_S):
        if os.environ.get(_ABANDON) is not None:
            log.warning(
                "mooncake: MC_TRANSFER_TIMEOUT=%s overridden to %s: the binding's timeout "
                "abandons batches still in flight",
                os.environ[_ABANDON],
                ABANDON_AFTER_S,
            )
        os.environ[_ABANDON] = str(ABANDON_AFTER_S)  # read by each TransferEngine() built


def pick_protocol(protocol: str | None, devices: Mapping[str, str]) -> str:
    """``protocol`` if given, else rdma where an RDMA device exists and tcp elsewhere; logged.

    ``devices`` is what ``xferkit.driver.rdma_devices()`` found.
    """
    if protocol is not None:
        if protocol not in PROTOCOLS:
            raise OptionError(f"mooncake: protocol {protocol!r} is not one of {PROTOCOLS}")
        log.info("mooncake: protocol %s (requested)", protocol)
        return protocol
    if devices:
        log.info("mooncake: protocol rdma (RDMA devices: %s)", sorted(devices))
        return "rdma"
    log.info("mooncake: protocol tcp (no RDMA device in %s)", INFINIBAND)
    return "tcp"


AVOID_TRIES = 8
"""Starts before an engine that took a fenced engine's port is kept (ports are drawn from
about 2,000, so one retry is rare and eight in a row never seen)."""

_starting = threading.Lock()  # one engine starts at a time: its data port is the new listener


def start(
    hostname: str, protocol: str, device: str, avoid: frozenset[int] = frozenset()
) -> tuple[TransferEngine, str, int | None]:
    """A started engine, its segment name (``host:rpc_port``) and, over TCP, the port its
    transport accepts peers' writes on (None where it cannot be told). An engine that took a
    port in ``avoid`` (a fenced engine's: peers cut off may still try it) is stopped and
    another started, a few times at most."""
    for tries in range(1, AVOID_TRIES + 1):
        engine, segment, data = _start(hostname, protocol, device)
        taken = {int(segment.rsplit(":", 1)[1]), data} & avoid
        if not taken or tries == AVOID_TRIES:
            return engine, segment, data
        log.info("mooncake: the new engine took port %s of a fenced one: another", taken)
        stop(engine, segment)
        del engine  # the last reference: destroyed now, its ports free
    raise AssertionError("unreachable")


def _start(hostname: str, protocol: str, device: str) -> tuple[TransferEngine, str, int | None]:
    with _starting:
        before = _listening_ports() if protocol == "tcp" else set()
        engine = TransferEngine()
        check(
            engine.initialize(hostname, "P2PHANDSHAKE", protocol, device),
            f"TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, {device!r})",
        )
        rpc = engine.get_rpc_port()
        # The binding names only the handshake port; the transport's listener is the other one
        # this start opened (another thread of the process opening one meanwhile makes two).
        new = _listening_ports() - before - {rpc} if protocol == "tcp" else set()
    return engine, f"{hostname}:{rpc}", new.pop() if len(new) == 1 else None


def stop(engine: TransferEngine, segment: str) -> None:
    """Make the engine's destructor fast; the caller then drops the last reference.

    The handshake listener blocks in accept() with a 1 s SO_RCVTIMEO and the
    destructor joins it, holding the GIL: every engine teardown stalled the
    whole process for about a second. Shortening the timeout on the listening
    socket, then waking the accept() in progress with a real probe, cuts that
    to about 15 ms, without any error in the engine's log.
    """
    port = int(segment.rsplit(":", 1)[1])
    listener = _listening_socket(port)
    if listener is None:
        return  # not Linux, or not found: the teardown just takes its second
    with listener, contextlib.suppress(OSError):
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 20_000))
    engine.send_probe(segment)


def _listening_socket(port: int) -> socket.socket | None:
    """A duplicate of this process's TCP socket listening on ``port``, if any."""
    found = None
    for sock in _tcp_sockets():
        try:
            if found is None and _listening(sock) and sock.getsockname()[1] == port:
                found = sock
                continue
        except OSError:
            pass
        sock.close()
    return found


def _listening_ports() -> set[int]:
    ports = set()
    for sock in _tcp_sockets():
        with sock, contextlib.suppress(OSError):
            if _listening(sock):
                ports.add(sock.getsockname()[1])
    return ports


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _tcp_sockets() -> Iterator[socket.socket]:
    """Duplicates of this process's TCP sockets (Linux: /proc/self/fd; elsewhere none); the
    caller closes each."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            yield sock
        else:
            sock.close()
