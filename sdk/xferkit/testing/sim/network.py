"""The simulated control network: one ordered pipe per DEALER connection, as ZMQ over TCP.

Within a connection ZMQ keeps order and never duplicates; what a crash or a
linger-less close leaves in flight is lost; a DEALER whose peer is down queues
what it sends and delivers it on reconnect, under a new ROUTER identity. A
partition delays both directions until it heals (TCP holds the bytes). The
harsh modes (``reorder``, ``duplicate``, ``loss``) go beyond what ZMQ can do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...session import wire
from .hostile import PREFILL

if TYPE_CHECKING:
    from .world import Rank, World

CAPTURED = 64
"""Messages decode ranks sent that a hostile peer may replay (the most recent)."""


@dataclass
class Link:
    """A decode rank's DEALER to a prefill address."""

    dec: str  # the rank that opened it (a decode rank, or a group's member)
    inc: int  # its incarnation
    conn: tuple
    pre: str
    ident: bytes
    base: str  # its ROUTER identities: ``base.<reconnects>``
    epoch: int = 0  # bumped when what is in flight is lost
    reconnects: int = 0
    closed: bool = False
    seen: bool = False  # delivered at least once: the TCP connection exists
    pre_inc: int = -1  # the prefill incarnation it last reached
    tail_up: float = 0.0  # FIFO: when the last message each way is delivered
    tail_down: float = 0.0
    backlog: list[wire.Message] = field(default_factory=list)


class Network:
    def __init__(self, world: World) -> None:
        self.w = world
        self.links: dict[tuple[str, int, tuple], Link] = {}
        self.idents: dict[bytes, Link] = {}
        self.partitions: dict[frozenset[str], float] = {}  # hosts -> healed at
        self.captured: deque[wire.Message] = deque(maxlen=CAPTURED)
        self.welcomes: deque[wire.Welcome] = deque(maxlen=8)  # honest ones, for a forger
        self._opened = 0

    # -- delays ---------------------------------------------------------------------

    def _latency(self) -> float:
        rng = self.w.rng
        if "delay" not in self.w.config.faults:
            return 0.0002
        x = rng.random()
        if x < 0.9:
            return rng.uniform(0.00005, 0.002)
        if x < 0.99:
            return rng.uniform(0.002, 0.5)
        return rng.uniform(0.5, 3.0)

    def _arrival(self, link: Link, up: bool) -> float:
        t = self.w.now + self._latency()
        if self.partitions:
            healed = self.partitions.get(frozenset((link.dec, link.pre)), 0.0)
            t = max(t, healed + self._latency()) if healed > self.w.now else t
        if "reorder" not in self.w.config.faults:
            tail = link.tail_up if up else link.tail_down
            t = max(t, tail)
            if up:
                link.tail_up = t
            else:
                link.tail_down = t
        return t

    def _copies(self) -> int:
        faults, rng = self.w.config.faults, self.w.rng
        if "loss" in faults and rng.random() < 0.02:
            return 0
        if "duplicate" in faults and rng.random() < 0.02:
            return 2
        return 1

    # -- what a rank's actions do ---------------------------------------------------

    def open(self, rank: Rank, conn: tuple) -> None:
        """A DEALER: to a prefill rank's pairs (``up``), roster (``group``) or, from a group's
        member, to the rank serving it (``member``)."""
        self._opened += 1
        base = f"{rank.name}.{rank.incarnation}.{self._opened}"
        link = Link(rank.name, rank.incarnation, conn, conn[1], f"{base}.0".encode(), base)
        self.links[rank.name, rank.incarnation, conn] = link
        self.idents[link.ident] = link

    def close(self, rank: Rank, conn: tuple, linger_ms: int) -> None:
        link = self.links.get((rank.name, rank.incarnation, conn))
        if link is None:
            return
        link.closed = True
        if linger_ms == 0:
            link.epoch += 1

    def send(self, rank: Rank, conn: tuple, msg: wire.Message) -> None:
        if conn[0] != "down":
            link = self.links.get((rank.name, rank.incarnation, conn))
            if link is None or link.closed:
                return
            self.captured.append(msg)
            for _ in range(self._copies()):
                self.w.at(self._arrival(link, True), self._arrive_up, link, link.epoch, msg)
        elif conn[0] == "down":
            link = self.idents.get(conn[1])
            if link is None or link.closed or link.pre != rank.name:
                return  # a ROUTER drops what it cannot route
            if isinstance(msg, wire.Welcome) and not msg.error:
                self.welcomes.append(msg)
            for _ in range(self._copies()):
                t = self._arrival(link, False)
                self.w.at(t, self._arrive_down, link, link.epoch, rank.incarnation, msg)

    def reply(self, link: Link, msg: wire.Message) -> None:
        """The hostile prefill sends ``msg`` down ``link`` (through the codec, as a shell
        decodes it)."""
        if not link.closed:
            t = self._arrival(link, False)
            self.w.at(t, self._arrive_down, link, link.epoch, 0, wire.decode(wire.encode(msg)))

    def _arrive_up(self, link: Link, epoch: int, msg: wire.Message) -> None:
        if epoch != link.epoch or self.w.ranks[link.dec].incarnation != link.inc:
            return
        if link.pre == PREFILL:
            assert self.w.hostile is not None
            self.w.hostile.from_decode(link, msg)
            return
        pre = self.w.ranks[link.pre]
        if not pre.alive:
            link.backlog.append(msg)  # the DEALER holds it until it reconnects
            return
        self._reach(link, pre)
        self.w.deliver(pre, ("down", link.ident), msg)

    def _reach(self, link: Link, pre: Rank) -> None:
        if link.pre_inc not in (-1, pre.incarnation):  # reconnected: a new ROUTER identity
            link.reconnects += 1
            link.ident = f"{link.base}.{link.reconnects}".encode()
            self.idents[link.ident] = link
        link.pre_inc = pre.incarnation
        link.seen = True

    def _arrive_down(self, link: Link, epoch: int, pre_inc: int, msg: wire.Message) -> None:
        pre = self.w.ranks.get(link.pre)  # None: the hostile prefill, which never restarts
        if epoch != link.epoch or link.closed or (pre is not None and pre.incarnation != pre_inc):
            return
        dec = self.w.ranks[link.dec]
        if dec.incarnation == link.inc and dec.alive:
            self.w.deliver(dec, link.conn, msg)

    # -- process faults -------------------------------------------------------------

    def gone(self, rank: Rank, graceful: bool = False) -> None:
        """``rank``'s process exited (a crash loses what it had in flight; a closed session's
        sockets linger until it left), and decode ranks connected to it see the close."""
        for link in list(self.links.values()):
            if link.dec == rank.name and link.inc == rank.incarnation:
                link.closed = True
                link.epoch += 0 if graceful else 1
            elif link.pre == rank.name and not link.closed:
                link.epoch += 0 if graceful else 1
                if link.seen and link.pre_inc == rank.incarnation:
                    dec = self.w.ranks[link.dec]
                    t = self.w.now + self._latency()
                    self.w.to(dec, t, "disconnected", link.conn)

    def back(self, rank: Rank) -> None:
        """``rank`` restarted: DEALERs that queued messages for it reconnect and send them."""
        for link in self.links.values():
            if link.pre == rank.name and link.backlog and not link.closed:
                queued, link.backlog = link.backlog, []
                for msg in queued:
                    self.w.at(self._arrival(link, True), self._arrive_up, link, link.epoch, msg)

    def partition(self, a: str, b: str, until: float) -> None:
        key = frozenset((a, b))
        self.partitions[key] = max(self.partitions.get(key, 0.0), until)
