"""A late message for a finished or aborted request is dropped, never applied.

One side is a real Session (real loopback, real ZMQ); the other is the test
speaking the wire protocol by hand over a raw socket with its own loopback
backend, so it can send what a well-behaved peer never would: a Request, a
completion tag, a ``Written`` or a ``Fail`` after the request ended, or a tag
carrying another generation of a live request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

import xferkit as xk
from xferkit.session import Session, State, fingerprint, wire
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 16, "state": 4}


class Fake:
    """The test's hand-driven side: a loopback backend and one ZMQ socket."""

    def __init__(self, manifest: xk.Manifest, kind: int) -> None:
        self.manifest = manifest
        self.backend = xk.open_backend("loopback")
        self.backend.register(manifest)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)

    def introduction(self, address: str) -> dict[str, object]:
        return {
            "version": wire.PROTOCOL_VERSION,
            "incarnation": 1,
            "address": address,
            "tp_rank": 0,
            "tp_size": 1,
            "fingerprint": fingerprint(self.manifest),
            "manifest": self.manifest.encode(),
            "backend": "loopback",
            "endpoint": self.backend.endpoint(),
            "driver_address": str(self.backend.driver.address),
        }

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.backend.close()


def _next(sock: zmq.Socket, kind: type, *, router: bool = False) -> tuple[bytes, object]:
    """The next message of type ``kind`` (heartbeats skipped), with the ROUTER identity."""
    while True:
        frames = sock.recv_multipart()
        ident, data = (frames[0], frames[1]) if router else (b"", frames[0])
        msg = wire.decode(data)
        if isinstance(msg, kind):
            return ident, msg


@pytest.fixture
def ref() -> Reference:
    return Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)


@pytest.fixture
def prefill(ref: Reference) -> Iterator[tuple[Session, Fake]]:
    """A real prefill Session and the test as its decode rank (handshake done)."""
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    fake = Fake(ref.dsts[0].manifest, zmq.DEALER)
    fake.sock.connect(pre.address)
    fake.sock.send(wire.encode(wire.Hello(**fake.introduction("tcp://fake-decode"))))  # type: ignore[arg-type]
    _, welcome = _next(fake.sock, wire.Welcome)
    assert isinstance(welcome, wire.Welcome) and not welcome.error, welcome
    yield pre, fake
    pre.close()
    fake.close()


def test_a_late_request_after_abort_writes_nothing(
    ref: Reference, prefill: tuple[Session, Fake]
) -> None:
    pre, fake = prefill
    send = pre.offer("r")
    request = wire.Request(
        rid="r",
        gen=1,
        needed=True,
        slots=wire.pack_slots({"kv": [1, 2]}),
        registration=fake.backend.generation,
    )
    fake.sock.send(wire.encode(request))
    fake.sock.send(wire.encode(wire.Abort(rid="r", gen=1, stage="abort", text="the test aborts")))
    _next(fake.sock, wire.AbortAck)
    with pytest.raises(xk.XferError, match="the test aborts"):
        send.wait(5)
    assert send.error is not None and send.error.stage == "abort"
    # Late: the same Request again, and one of another generation: each answered with the
    # root cause, neither starts a write.
    for gen in (1, 2):
        late = wire.Request(
            rid="r",
            gen=gen,
            needed=True,
            slots=wire.pack_slots({"kv": [3, 4]}),
            registration=fake.backend.generation,
        )
        fake.sock.send(wire.encode(late))
        _, fail = _next(fake.sock, wire.Fail)
        assert isinstance(fail, wire.Fail) and fail.gen == gen
        assert (fail.stage, fail.text) == ("abort", "the test aborts")
    send.write({"kv": [5, 6]}, last=True)  # the engine had not noticed yet: a no-op
    time.sleep(0.3)
    assert fake.backend.notifications() == []  # no completion was sent
    ref.check(0, {})  # and not one byte landed
    assert send.poll() is State.FAILED and str(send.error) == "the test aborts"
    assert pre.progress() == ["r"]


@pytest.fixture
def decode(ref: Reference) -> Iterator[tuple[Session, Fake, str]]:
    """A real decode Session and the test as its prefill rank (a ROUTER; address returned)."""
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    fake = Fake(ref.srcs[0].manifest, zmq.ROUTER)
    fake.sock.bind("tcp://127.0.0.1:*")
    address = fake.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    yield dec, fake, address
    dec.close()
    fake.close()


def test_late_completions_and_failures_are_never_applied(
    ref: Reference, decode: tuple[Session, Fake, str]
) -> None:
    dec, fake, address = decode
    recv = dec.expect("r", [address], {"kv": [1, 2]})
    ident, hello = _next(fake.sock, wire.Hello, router=True)
    assert isinstance(hello, wire.Hello)
    peer = fake.backend.connect(hello.endpoint, xk.Manifest.decode(hello.manifest))
    welcome = wire.Welcome(**fake.introduction(address))  # type: ignore[arg-type]
    fake.sock.send_multipart([ident, wire.encode(welcome)])
    _, first = _next(fake.sock, wire.Request, router=True)
    assert isinstance(first, wire.Request) and first.needed

    aborting = threading.Thread(target=recv.abort, args=(5,))
    aborting.start()
    _next(fake.sock, wire.Abort, router=True)
    fake.sock.send_multipart([ident, wire.encode(wire.AbortAck(rid="r", gen=first.gen))])
    aborting.join(5)
    assert recv.poll() is State.FAILED and recv.error is not None
    root = str(recv.error)
    assert recv.error.stage == "abort" and "aborted by the engine" in root

    # A misbehaving source keeps going: a completion tag after the data, a Written, a Fail.
    plan = xk.plan(ref.srcs[0].manifest, xk.Manifest.decode(hello.manifest))
    descs = plan.expand({"kv": ([0, 1], [1, 2])})
    tag = wire.encode(wire.Tag("r", first.gen, 0, 0, 1))
    fake.backend.write(peer, descs, tag).wait(5)
    late: list[wire.Message] = [
        wire.Written(rid="r", gen=first.gen, src_rank=0, seq=0, total=1),
        wire.Fail(rid="r", gen=first.gen, stage="transfer", text="a later consequence"),
    ]
    for msg in late:
        fake.sock.send_multipart([ident, wire.encode(msg)])

    # A new request; a completion tag of another generation must not count for it.
    again = dec.expect("r2", [address], {"kv": [3]})
    _, second = _next(fake.sock, wire.Request, router=True)
    assert isinstance(second, wire.Request) and second.rid == "r2" and second.gen != first.gen
    stale = wire.encode(wire.Tag("r2", first.gen, 0, 0, 1))
    fake.backend.write(peer, plan.expand({"kv": ([4], [3])}), stale).wait(5)
    time.sleep(0.3)
    assert again.poll() is State.WAITING  # the stale-generation tag was dropped
    assert recv.poll() is State.FAILED and str(recv.error) == root  # the root cause stands
    assert recv.error.stage == "abort"
    assert dec.progress() == ["r"]  # reported once

    fresh = wire.encode(wire.Tag("r2", second.gen, 0, 0, 1))
    fake.backend.write(peer, plan.expand({"kv": ([4], [3])}), fresh).wait(5)
    assert again.wait(5) is State.DONE
    assert dec.progress() == ["r2"]
