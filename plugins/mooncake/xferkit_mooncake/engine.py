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

from mooncake.engine import TransferEngine

from xferkit import CapabilityError, PluginError

from .codes import explain

log = logging.getLogger("xferkit.mooncake")

PROTOCOLS = ("rdma", "tcp")
INFINIBAND = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel exposes (empty without a NIC or its driver)."""
    try:
        return sorted(os.listdir(INFINIBAND))
    except OSError:
        return []


def pick_protocol(protocol: str | None) -> str:
    """``protocol`` if given, else rdma where a device exists and tcp elsewhere; logged."""
    if protocol is not None:
        if protocol not in PROTOCOLS:
            raise CapabilityError(
                f"mooncake: protocol {protocol!r} is not supported; use one of {PROTOCOLS}"
            )
        log.info("mooncake: protocol %s (requested)", protocol)
        return protocol
    devices = rdma_devices()
    if devices:
        log.info("mooncake: protocol rdma (RDMA devices in %s: %s)", INFINIBAND, devices)
        return "rdma"
    log.info("mooncake: protocol tcp (no RDMA device in %s)", INFINIBAND)
    return "tcp"


def start(hostname: str, protocol: str, device: str) -> tuple[TransferEngine, str]:
    """A started engine and its segment name."""
    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise PluginError(
            f"mooncake: TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
            f"{device!r}) returned {explain(rc)}; the engine's log on stderr says why"
        )
    return engine, f"{hostname}:{engine.get_rpc_port()}"


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
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname()[1] == port
            ):
                return sock
        except OSError:
            pass
        sock.close()
    return None
