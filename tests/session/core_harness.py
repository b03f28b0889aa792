"""Two or more protocol cores wired by hand: no sockets, no threads, no clock.

``Net`` owns a prefill core and a decode core (and any extra identities a test
injects), a queue of messages in flight per direction (ZMQ keeps order within a
connection), a driver model that holds posted writes until the test lets them
end, and a record of what each handle was told. Tests step it explicitly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from xferkit.copier import CPU
from xferkit.descriptors import Descriptors
from xferkit.driver import CONTRACT_VERSION
from xferkit.endpoint import Envelope
from xferkit.manifest import Manifest
from xferkit.session import actions as act
from xferkit.session import wire
from xferkit.session.core import Settings
from xferkit.session.protocol import Protocol
from xferkit.session.rounds import Staging
from xferkit.session.states import RequestError, State
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 64, "state": 16}
LOOKUP = b"D-lookup"
"""The ROUTER identity of D's roster lookups (``group+P``): a DEALER of its own."""


def endpoint(address: str, generation: int = 1) -> bytes:
    env = Envelope(
        "loopback", CONTRACT_VERSION, "host", 1, address, generation, msgspec.Raw(b"\x90")
    )
    return msgspec.msgpack.encode(env)


def settings(address: str, manifest: Manifest, driver: str, **kw: Any) -> Settings:
    return Settings(
        address=address,
        incarnation=hash(address) & 0xFFFF,
        manifest=manifest,
        backend="loopback",
        driver_name=f"loopback:{driver}",
        endpoint=endpoint(driver),
        fingerprint="f",
        notifying=True,
        **kw,
    )


@dataclass
class Handle:
    """What an engine's handle would be told, in order."""

    request_id: str
    states: list[State] = field(default_factory=list)
    failing: RequestError | None = None
    error: RequestError | None = None

    @property
    def state(self) -> State | None:
        return self.states[-1] if self.states else None


@dataclass
class Write:
    wid: int
    rid: str
    peer: Any
    note: bytes | None
    descs: Descriptors | None = None
    cancelled: bool = False


class Net:
    """Prefill ``pre`` (address P) and decode ``dec`` (address D) cores, wired by hand."""

    def __init__(self, staging_bytes: int = 0, hold_connects: bool = False, **kw: Any) -> None:
        """``staging_bytes``: each side registers that much staging, in slices of a quarter,
        and stages every chunk (``staging="always"``). ``hold_connects``: the prefill's
        driver connects only when the test says (``connect``)."""
        self.hold_connects = hold_connects
        self.ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
        cores = []
        for address, rank, driver in (
            ("P", self.ref.srcs[0], "p-drv"),
            ("D", self.ref.dsts[0], "d-drv"),
        ):
            manifest, extra = rank.manifest, dict(kw)
            if staging_bytes:
                buffer = Staging(manifest, staging_bytes)
                manifest = buffer.manifest
                extra.update(staging="always", arena=buffer.arena(staging_bytes // 4), copier=CPU)
            cores.append(Protocol(settings(address, manifest, driver, **extra)))
        self.pre, self.dec = cores
        self.now = 0.0
        self.to_pre: deque[tuple[bytes, wire.Message]] = deque()  # (ident, msg)
        self.to_dec: deque[tuple[str, wire.Message]] = deque()  # (prefill address, msg)
        self.to_others: list[tuple[bytes, wire.Message]] = []  # what P sent other identities
        self.to_lookup: deque[wire.Message] = deque()  # P's answers to D's roster lookups
        self.writes: dict[int, Write] = {}  # posted, not ended
        self.ended: list[Write] = []
        self.connects: list[act.Connect] = []
        self.handles: dict[tuple[str, str], Handle] = {}  # (side, rid)
        self.finished: dict[str, list[str]] = {"pre": [], "dec": []}
        self.failed_with_writes: list[str] = []  # rids FAILED on decode while writes were live
        self.paired: list[tuple[str, str, str]] = []  # (role, peer, event) as on_pair is told
        self.fences: list[str] = []  # the sources the decode core asked its driver to fence
        self.dec_conn: tuple = ("up", "P", 0)  # the decode core's open connection to P

    # -- carrying out actions --------------------------------------------------------

    def apply(self, side: str, actions: list[act.Action]) -> None:
        for a in actions:
            if isinstance(a, act.Open) and a.conn[:2] == ("up", "P"):
                self.dec_conn = a.conn
            elif isinstance(a, act.Send):
                if side == "dec":
                    assert a.conn[0] in ("up", "group")
                    if a.conn == ("group", "P"):  # D's lookup DEALER: another identity
                        self.to_pre.append((LOOKUP, a.msg))
                    elif a.conn[1] == "P":
                        self.to_pre.append((b"D", a.msg))
                elif a.conn == ("down", b"D"):
                    self.to_dec.append(("P", a.msg))
                elif a.conn == ("down", LOOKUP):
                    self.to_lookup.append(a.msg)
                else:
                    self.to_others.append((a.conn[1], a.msg))
            elif isinstance(a, act.Connect):
                self.connects.append(a)
                if not self.hold_connects:
                    self.connect(a)
            elif isinstance(a, act.Post):
                note = wire.decode_note(a.note) if a.note else None
                self.writes[a.wid] = Write(a.wid, note.rid if note else "", a.peer, a.note, a.descs)
            elif isinstance(a, act.Fence):
                self.fences.append(a.source)
            elif isinstance(a, act.Cancel):
                if a.wid in self.writes:
                    self.writes[a.wid].cancelled = True
            elif isinstance(a, act.Move | act.Done | act.Failed | act.Failing):
                h = a.handle
                if isinstance(a, act.Move):
                    h.states.append(a.state)
                elif isinstance(a, act.Done):
                    h.states.append(State.DONE)
                elif isinstance(a, act.Failing):
                    h.failing = a.error
                else:
                    h.error = a.error
                    h.states.append(State.FAILED)
                    live = [w for w in self.writes.values() if w.rid == h.request_id]
                    if side == "dec" and live:
                        self.failed_with_writes.append(h.request_id)
            elif isinstance(a, act.Finished):
                self.finished[side].append(a.rid)
            elif isinstance(a, act.Paired):
                self.paired.append((a.event.role, a.event.peer, a.event.event))

    # -- engine commands -----------------------------------------------------------------

    def expect(
        self, rid: str, slots: dict[str, list[int]], sources: tuple[str, ...] = ("P",)
    ) -> Handle:
        """``sources``: P, or ``group+P`` (P serves its group's roster: itself, TP 1)."""
        import numpy as np

        h = self.handles["dec", rid] = Handle(rid, [State.HANDSHAKING])
        arrays = {p: np.asarray(s, dtype=np.int64) for p, s in slots.items()}
        self.apply("dec", self.dec.expect(h, rid, sources, arrays, 1, {}, self.now))
        return h

    def offer(self, rid: str) -> Handle:
        h = self.handles["pre", rid] = Handle(rid, [State.WAITING])
        self.apply("pre", self.pre.offer(h, rid, self.now))
        return h

    def write(self, rid: str, slots: dict[str, list[int]], last: bool) -> None:
        import numpy as np

        arrays = {p: np.asarray(s, dtype=np.int64) for p, s in slots.items()}
        self.apply("pre", self.pre.write(self.handles["pre", rid], arrays, last, None, self.now))

    def abort(self, side: str, rid: str) -> None:
        core = self.pre if side == "pre" else self.dec
        self.apply(side, core.abort(self.handles[side, rid], self.now))

    # -- the network, the driver, time -----------------------------------------------------

    def deliver(self, limit: int = 1000) -> None:
        """Deliver every message in flight, both ways, in order, until none is left."""
        for _ in range(limit):
            if self.to_pre:
                ident, msg = self.to_pre.popleft()
                self.apply("pre", self.pre.receive(("down", ident), msg, self.now))
            elif self.to_dec:
                _, msg = self.to_dec.popleft()
                self.apply("dec", self.dec.receive(self.dec_conn, msg, self.now))
            elif self.to_lookup:
                msg = self.to_lookup.popleft()
                self.apply("dec", self.dec.receive(("group", "P"), msg, self.now))
            else:
                return

    def connect(self, a: act.Connect, error: str = "") -> None:
        """The prefill's driver connected (or failed to) for ``a``."""
        peer = None if error else ("peer", a.key)
        self.apply("pre", self.pre.connected(a.key, peer, 1, error, self.now))

    def inject(self, ident: bytes, msg: wire.Message) -> None:
        """A message to the prefill core from another identity (a third peer)."""
        self.apply("pre", self.pre.receive(("down", ident), msg, self.now))

    def finish(self, wid: int, error: str = "") -> None:
        """Write ``wid`` ends in the driver: DONE (its notification reaches the decode core,
        after the data) or failed."""
        w = self.writes.pop(wid)
        self.ended.append(w)
        if not error and not w.cancelled and w.note is not None and w.peer == ("peer", b"D"):
            self.apply("dec", self.dec.notification("loopback:p-drv", w.note, self.now))
        self.apply(
            "pre", self.pre.write_ended(wid, error if error or not w.cancelled else "", self.now)
        )

    def finish_all(self) -> None:
        while self.writes:
            self.finish(next(iter(self.writes)))
            self.deliver()

    def advance(self, seconds: float) -> None:
        """Time passes; both cores' timers run along the way (as their shells would), and the
        network delivers what they send."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + 0.05)
            self.apply("pre", self.pre.timer(self.now))
            self.apply("dec", self.dec.timer(self.now))
            self.deliver()

    def handshake(self) -> None:
        """Open the pair with a first request, to DONE."""
        self.expect("warm", {"kv": [0]})
        self.deliver()
        self.offer("warm")
        self.write("warm", {"kv": [0]}, last=True)
        self.finish_all()
        self.deliver()
        assert self.handles["dec", "warm"].state is State.DONE
        assert self.handles["pre", "warm"].state is State.DONE
