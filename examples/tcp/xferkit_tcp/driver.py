"""A two-sided driver: the sender streams frames over TCP, the receiver writes its own memory.

Written from docs/plugins.md and ``xferkit.driver`` alone, as a third-party
author would. Simple on purpose (a Python loop per descriptor, one batch in
flight per connection); what it shows is the part a two-sided transport must
get right: once the sender has reported a batch ended, no byte of it lands.

- The sender posts each batch to a ``BatchWorker`` per connection, which sends
  the frame and waits for the receiver's answer. Released while running
  (``batch.cancelled``), it sends ABORT and waits ``abort_wait_s`` for the
  answer; without one (a frozen receiver) it hangs up with a reset, so the
  receiver's kernel holds nothing it could still deliver.
- The receiver applies a frame only after reading everything its socket
  holds: a frame followed by an ABORT for it, by end of connection or by a
  reset is dropped, never written.
- It fences (``fencing``): ``fence(source)`` refuses from then on every frame of
  the links ``source`` made from an endpoint of before, on any connection they
  open; the endpoint's new epoch makes the links of a new handshake work.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from xferkit.driver import (
    AddressTable,
    BatchWorker,
    Capabilities,
    Descriptors,
    Driver,
    DriverOptions,
    Manifest,
    Posted,
    QueuedBatch,
    Region,
)

from . import wire

MAX_BATCH = 256  # descriptors per frame: the core splits larger writes
# `xferkit bench calibrate tcp-example` on the 2-core CI host (3.1 us/descriptor, 0.18 GB/s):
DESCRIPTOR_BYTES = 550
COPY_COST = 0.071
TICK_S = 0.05  # how often a waiting thread looks at cancellation and shutdown


class TcpOptions(DriverOptions, frozen=True):
    host: Annotated[str, msgspec.Meta(min_length=1, description="address to listen on")] = (
        "127.0.0.1"
    )
    abort_wait_s: Annotated[
        float,
        msgspec.Meta(
            gt=0, le=60, description="how long an aborted batch waits for the receiver's answer"
        ),
    ] = 0.5
    careless: Annotated[
        bool,
        msgspec.Meta(
            description="the mistakes the kit's frozen-peer test catches: finish a frame after "
            "an abort, hang up without a reset and apply frames even after an abort or the end "
            "of their connection (for that test only)"
        ),
    ] = False


class TcpBlob(msgspec.Struct, frozen=True):
    host: str
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    generation: Annotated[int, msgspec.Meta(ge=0)]  # of the receiver's registrations
    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0  # of its fences: links from before are cut


class _Batch(QueuedBatch):
    __slots__ = ("id",)

    def __init__(self, descs: Descriptors | None, notify: bytes | None) -> None:
        super().__init__(descs, notify)
        self.id = next(_ids)


_ids = itertools.count(1)


class _Link:
    """The sender's side of one connection: a socket, reopened after a hang-up, and a worker."""

    def __init__(self, driver: TcpDriver, blob: TcpBlob) -> None:
        self.driver, self.blob = driver, blob
        self.sock: socket.socket | None = None
        self.replies = bytearray()
        self.worker: BatchWorker[_Batch] = BatchWorker(self.execute, f"tcp-send-{blob.port}")

    def open(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection((self.blob.host, self.blob.port), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = f"{self.driver.address} {self.blob.epoch}".encode()
            sock.sendall(wire.encode(wire.HELLO, body=hello))
            sock.setblocking(False)
            self.sock, self.replies = sock, bytearray()
        return self.sock

    def hang_up(self) -> None:
        """Close with a reset: what the receiver's kernel has not yet delivered is discarded."""
        if self.sock is not None:
            if not self.driver.options.careless:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
            self.sock = None

    def execute(self, batch: _Batch) -> str | None:
        """Send the batch, wait for its answer; the error text or None (the worker's contract)."""
        try:
            sock = self.open()
        except OSError as exc:
            return f"cannot reach {self.blob.host}:{self.blob.port}: {exc}"
        frame = self.frame(batch)
        view, sent = memoryview(frame), 0
        while sent < len(frame):
            if batch.cancelled and not self.driver.options.careless:  # mid-frame: the
                # receiver will drop the part it has (a careless sender finishes the frame)
                self.hang_up()
                return "aborted while sending (hung up)"
            if select.select([], [sock], [], TICK_S)[1]:
                try:
                    sent += sock.send(view[sent:])
                except OSError as exc:
                    self.hang_up()
                    return f"connection to {self.blob.host}:{self.blob.port} broke: {exc}"
        return self.answer(sock, batch)

    def frame(self, batch: _Batch) -> bytes:
        d = batch.descs
        if d is None or not len(d):
            return wire.encode(wire.BATCH, batch.id, self.blob.generation, notify=batch.notify)
        pieces = [  # the example's simplicity: a real engine gathers in one call
            ctypes.string_at(s, n) for s, n in zip(d.src.tolist(), d.nbytes.tolist(), strict=True)
        ]
        return wire.encode(
            wire.BATCH, batch.id, self.blob.generation, d.dst, d.nbytes, batch.notify,
            b"".join(pieces),
        )  # fmt: skip

    def answer(self, sock: socket.socket, batch: _Batch) -> str | None:
        """Wait for DONE/FAILED; released meanwhile: ABORT, then hang up if no answer comes."""
        given_up: float | None = None
        while True:
            if batch.cancelled and given_up is None:
                given_up = time.monotonic() + self.driver.options.abort_wait_s
                with contextlib.suppress(OSError):
                    sock.send(wire.encode(wire.ABORT, batch.id))  # best effort
            if given_up is not None and time.monotonic() > given_up:
                self.hang_up()
                return "aborted; the receiver did not answer (hung up: it drops what it holds)"
            if not select.select([sock], [], [], TICK_S)[0]:
                continue
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError as exc:
                data, why = b"", str(exc)
            else:
                why = "closed by the receiver"
            if not data:
                self.hang_up()
                return f"connection to {self.blob.host}:{self.blob.port} {why}"
            self.replies += data
            while (reply := wire.decode(self.replies)) is not None:
                if reply.id == batch.id:
                    return None if reply.kind == wire.DONE else reply.body.decode()


class _Inbound(threading.Thread):
    """The receiver's side of one connection: read everything, apply what was not revoked."""

    def __init__(self, driver: TcpDriver, sock: socket.socket) -> None:
        super().__init__(name="tcp-receive", daemon=True)
        self.driver, self.sock = driver, sock
        self.sender, self.epoch = "?", 0
        self.buf = bytearray()
        self.frames: deque[wire.Frame] = deque()
        self.aborted: set[int] = set()

    def run(self) -> None:
        self.sock.setblocking(False)
        try:
            while not self.driver.closing:
                if not self.frames and not select.select([self.sock], [], [], TICK_S)[0]:
                    continue
                if self.read_all():  # end of connection: drop whatever is not applied
                    if self.driver.options.careless:  # ... unless written carelessly
                        while self.frames:
                            self.handle(self.frames.popleft())
                    return
                if self.frames:
                    self.handle(self.frames.popleft())
        finally:
            self.sock.close()

    def read_all(self) -> bool:
        """Take everything the socket holds now; True when the connection has ended."""
        ended = False
        while not ended:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError:  # reset: the sender gave up
                data = b""
            ended = not data
            self.buf += data
        while (frame := wire.decode(self.buf)) is not None:
            if frame.kind == wire.ABORT:
                self.aborted.add(frame.id)
            else:
                self.frames.append(frame)
        return ended

    def handle(self, f: wire.Frame) -> None:
        if f.kind == wire.HELLO:
            sender, _, epoch = f.body.decode().partition(" ")
            self.sender, self.epoch = sender, int(epoch) if epoch.isdigit() else 0
            return
        revoked = f.id in self.aborted and not self.driver.options.careless
        error = "aborted by the sender" if revoked else self.driver.apply(f, self)
        if error is None and f.notify is not None:
            self.driver.deliver(self.sender, f.notify)
        reply = wire.DONE if error is None else wire.FAILED
        self.sock.setblocking(True)
        try:
            self.sock.sendall(wire.encode(reply, f.id, body=(error or "").encode()))
        except OSError:
            pass
        finally:
            self.sock.setblocking(False)


class TcpDriver(Driver):
    name: ClassVar[str] = "tcp-example"
    Blob: ClassVar[type[msgspec.Struct]] = TcpBlob
    Options: ClassVar[type[DriverOptions] | None] = TcpOptions

    def __init__(self, options: TcpOptions) -> None:
        self.options = options
        self.capabilities = Capabilities(
            memory=frozenset({"cpu"}),
            notifications=True,
            cross_process=True,
            fencing=True,
            max_batch=MAX_BATCH,
            descriptor_bytes=DESCRIPTOR_BYTES,
            copy_cost=COPY_COST,
        )
        self.listener = socket.create_server((options.host, 0))
        self.listener.settimeout(TICK_S)
        self.port = self.listener.getsockname()[1]
        self.address = f"{options.host}:{self.port}"
        self.closing = False
        self.lock = threading.Lock()  # registrations against the frames being applied
        self.regions: dict[int, int] = {}  # start -> nbytes
        self.generation = 0
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.inbound: list[_Inbound] = []
        self.epoch = 0  # the fences so far: a link made from an endpoint of epoch e says e
        self.fenced: dict[str, int] = {}  # sender -> its links of this epoch or older are cut
        self.acceptor = threading.Thread(target=self.accept, name="tcp-accept", daemon=True)
        self.acceptor.start()

    # -- receiving ------------------------------------------------------------

    def accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            inbound = _Inbound(self, sock)
            with self.lock:
                self.inbound = [t for t in self.inbound if t.is_alive()] + [inbound]
            inbound.start()

    def apply(self, f: wire.Frame, inbound: _Inbound) -> str | None:
        """Write a frame into registered memory, checked now (as a NIC checks remote keys)."""
        with self.lock:
            if inbound.epoch <= self.fenced.get(inbound.sender, -1):
                return f"fenced: {self.address} cut the links {inbound.sender} held"
            if f.generation != self.generation:
                return f"stale endpoint: {self.address} re-registered its memory"
            if not len(f.dst):
                return None
            starts = list(self.regions)
            table = AddressTable(starts, [self.regions[s] for s in starts])
            bad = table.first_outside(f.dst, f.nbytes)
            if bad >= 0:
                return f"destination {int(f.dst[bad]):#x} is not registered at {self.address}"
            payload = np.frombuffer(f.body, dtype=np.uint8)
            offsets = np.concatenate(([0], np.cumsum(f.nbytes)[:-1])).astype(np.uint64)
            base = payload.ctypes.data
            for d, o, n in zip(f.dst.tolist(), offsets.tolist(), f.nbytes.tolist(), strict=True):
                ctypes.memmove(d, base + o, n)
        return None

    def fence(self, source: str) -> None:
        """Cut every link ``source`` made from an endpoint of before: their frames are refused
        from now on (a frame applies under ``lock``), on any connection they open again; the
        endpoint's new epoch makes the links of a new ``connect`` (a new handshake) work."""
        with self.lock:
            self.fenced[source] = self.epoch
            self.epoch += 1

    def deliver(self, sender: str, message: bytes) -> None:
        with self.lock:
            self.inbox.append((sender, message))

    # -- the contract -----------------------------------------------------------

    def register_region(self, region: Region) -> None:
        with self.lock:
            self.regions[region.addr] = region.nbytes
            self.generation += 1

    def deregister_region(self, region: Region) -> None:
        with self.lock:
            self.regions.pop(region.addr, None)
            self.generation += 1

    def endpoint(self) -> TcpBlob:
        with self.lock:
            return TcpBlob(self.options.host, self.port, self.generation, self.epoch)

    def connect(self, blob: Any, manifest: Manifest) -> _Link:
        link = _Link(self, blob)
        link.open()  # refuse an unreachable peer now, not at the first write
        return link

    def disconnect(self, link: Any) -> None:
        link.worker.stop()
        link.worker.join(5.0)
        if link.sock is not None:
            link.sock.close()

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        batch = _Batch(descs, notify)
        link.worker.post(batch)
        return batch

    def notify(self, link: Any, message: bytes) -> Posted:
        batch = _Batch(None, message)
        link.worker.post(batch)
        return batch

    def notifications(self) -> list[tuple[str, bytes]]:
        with self.lock:
            out = list(self.inbox)
            self.inbox.clear()
        return out

    def close(self) -> None:
        self.closing = True
        self.listener.close()
        self.acceptor.join(5.0)
        with self.lock:
            inbound = list(self.inbound)
        for t in inbound:
            with contextlib.suppress(OSError):
                t.sock.shutdown(socket.SHUT_RDWR)
            t.join(5.0)
