"""The simulated driver: writes with the backend contract's semantics, over real memory.

A post is taken by the rank's data-plane worker (stopped with its process; a
post that waited past its horizon is refused), then its bytes land after a
delay, the peer's notification follows the data, and the write ends. Faults
from the seed: a write fails after part of its bytes landed, or stalls until
its timeout; ``late`` (harsh) lands bytes after the write was reported ended.
A write to a peer that is gone (crashed, restarted, closed) fails and lands
nothing: its registration went with its process. Writes of a rank that crashes
and have not landed never land (the kernel tears its queues down first).
Under ``Config.fencing`` a decode rank's driver fences a source as a NIC that
invalidates the keys it gave would: the links made from its endpoints of
before land nothing more, whatever is in flight (late and frozen writes
included), and its endpoint carries the next epoch; under ``Config.fence_cuts_all`` the
links every other source made from those endpoints land nothing more either (a driver that
refuses by registration, as Mooncake over TCP). Under ``Config.ends_final=False`` a write
cancelled after the worker took it still lands, ended or not (NIXL's release over UCX's
TCP transport), and a notification with no data (the core's ``Ended``) lands after every
byte its rank's writes to that peer had in flight: the promise such a driver keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ...descriptors import Descriptors
from ...driver import CONTRACT_VERSION
from ...endpoint import Envelope, endpoint_address
from ...session import actions as act
from ...session import wire
from ..reference import execute
from .hostile import HOSTILE

if TYPE_CHECKING:
    from .world import Rank, World


def endpoint(name: str, epoch: int) -> bytes:
    """Rank ``name``'s endpoint: its driver address, and the epoch of its fences."""
    blob = msgspec.Raw(msgspec.msgpack.encode(epoch))
    return msgspec.msgpack.encode(
        Envelope("sim", CONTRACT_VERSION, "host", 1, f"{name}-drv", 1, blob)
    )


def _epoch(raw: bytes) -> int:
    env = msgspec.msgpack.decode(raw, type=Envelope)
    return int(msgspec.msgpack.decode(bytes(env.blob)))


@dataclass
class Write:
    wid: int
    pre: str
    pre_inc: int
    peer: tuple  # ("peer", decode rank, its incarnation, the epoch of its endpoint)
    descs: Descriptors
    tag: wire.Tag | None
    note: bytes | None
    landed: bool = False
    cancelled: bool = False
    started: bool = False  # the worker took it: the driver has it
    ended: bool = False


class Driver:
    def __init__(self, world: World) -> None:
        self.w = world
        self.writes: dict[tuple[str, int], Write] = {}  # (prefill rank, wid) -> not ended
        self.epochs: dict[str, int] = {}  # decode rank -> the fences its driver made
        self.fenced: dict[tuple[str, str], int] = {}  # (decode, source) -> links up to it cut
        self.fenced_all: dict[str, int] = {}  # decode -> every source's links up to it cut
        self.tails: dict[tuple, float] = {}  # (prefill, its incarnation, peer) -> last landing

    def pending(self, rank: Rank) -> int:
        return sum(1 for (pre, _), wr in self.writes.items() if pre == rank.name)

    def connect(self, rank: Rank, a: act.Connect) -> None:
        """Connect to the rank whose driver the endpoint names (whoever sent it); slowly now
        and then, past a liveness bound (a busy data-plane worker, a lost SYN)."""
        name = endpoint_address(a.endpoint).removesuffix("-drv")
        dec = self.w.ranks.get(name)
        t = self.w.now + self._busy()
        if name == HOSTILE:  # its own driver and memory: writes to it land nowhere we check
            self.w.to(rank, t, "connected", a.key, ("peer", HOSTILE, 0, 0), 1, "")
            return
        if dec is None or not dec.alive or dec.role != "decode":
            self.w.to(rank, t, "connected", a.key, None, 0, f"connect: {name}-drv unreachable")
            return
        peer = ("peer", dec.name, dec.incarnation, _epoch(a.endpoint))
        self.w.to(rank, t, "connected", a.key, peer, 1, "")

    def fence(self, rank: Rank, source: str) -> None:
        """``rank``'s data-plane worker fences ``source`` (slowly now and then: a busy worker)."""
        self.w.at(self.w.now + self._busy(), self._fence, rank, rank.incarnation, source)

    def _busy(self) -> float:
        """How long a call on a data-plane worker takes: mostly quick, a tenth up to 2 s."""
        rng = self.w.rng
        return rng.uniform(0.0001, 0.01) if rng.random() < 0.9 else rng.uniform(0.01, 2)

    def _fence(self, rank: Rank, inc: int, source: str) -> None:
        if rank.incarnation != inc or not rank.alive:
            return
        if rank.paused_until > self.w.now:
            self.w.at(self.w.resumed(rank), self._fence, rank, inc, source)
            return
        epoch = self.epochs.get(rank.name, 0)
        self.fenced[rank.name, source] = epoch
        if self.w.config.fence_cuts_all:
            self.fenced_all[rank.name] = epoch
        self.epochs[rank.name] = epoch + 1
        self.w.to(rank, self.w.now, "fenced", source, "", endpoint(rank.name, epoch + 1))

    def _cut(self, wr: Write) -> bool:
        source = self.w.ranks[wr.pre].driver_name
        cut = max(self.fenced.get((wr.peer[1], source), -1), self.fenced_all.get(wr.peer[1], -1))
        return cut >= wr.peer[3]

    def post(self, rank: Rank, a: act.Post) -> None:
        if a.note is not None:
            note = wire.decode_note(a.note)
            tag: wire.Tag | None = note if isinstance(note, wire.Tag) else None
        else:  # no notification: the checker reads the write's tag from the core
            got = rank.proto.outgoing.writes.get(a.wid)
            tag = None if got is None else got[1].pending.get(a.wid)
        wr = Write(a.wid, rank.name, rank.incarnation, a.peer, a.descs, tag, a.note)
        self.writes[rank.name, a.wid] = wr
        t = self.w.now + self.w.rng.uniform(0.000001, 0.0002)  # a hand-off to the worker
        self.w.at(t, self._start, rank, wr, a)

    def _start(self, rank: Rank, wr: Write, a: act.Post) -> None:
        """The worker takes the post (later, if its process is stopped)."""
        if rank.incarnation != wr.pre_inc or not rank.alive:
            self.writes.pop((wr.pre, wr.wid), None)
            return
        if rank.paused_until > self.w.now:
            self.w.at(self.w.resumed(rank), self._start, rank, wr, a)
            return
        if rank.local(self.w.now) - a.made > a.horizon:
            self._end(rank, wr, "refused: the post waited past its horizon")
            return
        wr.started = True
        if wr.cancelled:  # a Cancel behind it in the worker's queue: it is posted, then aborted
            self.w.at(self.w.now, self.cancel, rank, wr.wid)
        rng, faults = self.w.rng, self.w.config.faults
        lat = rng.uniform(0.0001, 0.005) if rng.random() < 0.95 else rng.uniform(0.005, 1.5)
        land = self.w.now + lat
        if wr.peer[1] == HOSTILE:
            self.w.at(land, self._end, rank, wr, "")
            return
        dec = self.w.ranks.get(wr.peer[1])
        if dec is None or not dec.alive or dec.incarnation != wr.peer[2]:
            self.w.at(land, self._end, rank, wr, f"peer {wr.peer} unreachable")
            return
        if dec.memory.manifest.first_outside(wr.descs.dst, wr.descs.nbytes) >= 0:
            # The Backend's guard: nothing goes outside what the peer advertised.
            self.w.at(self.w.now, self._end, rank, wr, "a descriptor lies outside the peer")
            return
        x = rng.random()
        if not len(wr.descs):  # a notification alone: behind the bytes in flight to that peer
            t = max(land, self.tails.get(self._link(wr), 0.0) + 0.00001)
            self.w.at(t, self._land, wr, 1.0)
            self.w.at(t + 0.00001, self._end, rank, wr, "")
            return
        self._tail(wr, land)
        if self._cut(wr):  # the receiving NIC refuses it
            self.w.at(land, self._end, rank, wr, "fenced by the receiver")
        elif "stall" in faults and x < 0.02:
            t = self.w.now + max(a.timeout, 0.0) + rng.uniform(0, 0.5)
            self.w.at(t, self._end, rank, wr, f"timed out after {a.timeout:.3f} s")
        elif "fail" in faults and x < 0.05:
            self.w.at(land, self._land, wr, rng.random())
            self.w.at(land + 0.0001, self._end, rank, wr, "transport error (simulated)")
        elif "late" in faults and x < 0.08:
            self.w.at(land, self._end, rank, wr, "transport error (simulated), bytes in flight")
            late = land + rng.uniform(0.1, 2.0)
            self._tail(wr, late)
            self.w.at(late, self._land, wr, 1.0, True)
        else:
            self.w.at(land, self._land, wr, 1.0)
            self.w.at(land + rng.uniform(0.00001, 0.001), self._end, rank, wr, "")

    def _link(self, wr: Write) -> tuple:
        return (wr.pre, wr.pre_inc, wr.peer)

    def _tail(self, wr: Write, t: float) -> None:
        """A landing of ``wr`` is due at ``t``: a later notification to its peer comes after."""
        link = self._link(wr)
        self.tails[link] = max(self.tails.get(link, 0.0), t)

    def _land(self, wr: Write, share: float, late: bool = False) -> None:
        """Bytes reach the peer's memory (``share`` of the descriptors, in order)."""
        pre = self.w.ranks[wr.pre]
        sent = wr.cancelled and not self.w.config.ends_final  # released, and sent all the same
        if not late and ((wr.ended and not sent) or pre.incarnation != wr.pre_inc or not pre.alive):
            return
        if self._frozen(pre):  # its transport's threads are stopped with it
            resumed = self.w.resumed(pre)
            self._tail(wr, resumed)
            self.w.at(resumed, self._land, wr, share, late)
            return
        dec = self.w.ranks[wr.peer[1]]
        if not dec.alive or dec.incarnation != wr.peer[2] or self._cut(wr):
            return
        n = len(wr.descs) if share >= 1.0 else int(len(wr.descs) * share)
        descs = wr.descs
        if n < len(descs):
            descs = Descriptors(descs.src[:n], descs.dst[:n], descs.nbytes[:n])
        if n:
            self.w.check.landing(wr, descs, late or (sent and wr.ended), released=sent)
            execute(descs)
        wr.landed = True
        if share >= 1.0 and wr.note is not None and not late and not wr.cancelled:
            t = self.w.now + self.w.rng.uniform(0.00001, 0.002)
            self.w.to(dec, t, "notification", pre.driver_name, wr.note)

    def _frozen(self, rank: Rank) -> bool:
        """Under ``frozen`` (harsh), a stopped rank's driver moves nothing until it resumes:
        what a TCP transport had in flight lands after SIGCONT (issue 21 measured megabytes
        landing in reused slots); an RDMA NIC, modelled by default, goes on without it."""
        return "frozen" in self.w.config.faults and rank.paused_until > self.w.now

    def _end(self, rank: Rank, wr: Write, error: str) -> None:
        if wr.ended:
            return
        if self._frozen(rank):
            self.w.at(self.w.resumed(rank), self._end, rank, wr, error)
            return
        wr.ended = True
        self.writes.pop((wr.pre, wr.wid), None)
        if rank.incarnation == wr.pre_inc and rank.alive:
            if wr.cancelled and not error:
                error = "cancelled"
            self.w.to(rank, self.w.now, "write_ended", wr.wid, error)

    def cancel(self, rank: Rank, wid: int) -> None:
        """The worker aborts the write; one it has not taken yet it takes first (a Cancel
        queues behind its Post, and a small Post is made inline by the control thread)."""
        wr = self.writes.get((rank.name, wid))
        if wr is None or wr.ended:
            return
        wr.cancelled = True
        if not wr.started:
            return
        if not wr.landed:  # the driver lets go soon; a landing racing it may still happen
            t = self.w.now + self.w.rng.uniform(0.0001, 0.01)
            self.w.at(t, self._end, rank, wr, "cancelled")

    def gone(self, rank: Rank) -> None:
        for key in [k for k in self.writes if k[0] == rank.name]:
            del self.writes[key]
        self.epochs.pop(rank.name, None)  # a new process: a new driver
        for fence in [k for k in self.fenced if k[0] == rank.name]:
            del self.fenced[fence]
        self.fenced_all.pop(rank.name, None)
