"""The Session's protocol core: events and ``now`` in, actions out.

Like h11's ``Connection`` or aioquic's ``QuicConnection``, ``Protocol`` owns
no socket, thread, clock or driver. Every entry point takes one event (an
engine command, a message tagged with the connection it came on, a driver
event, a timer) and the time, and returns the actions it calls for
(``actions``). The shell carries them out; a test or a simulator can drive
two or more Protocols by hand.

It routes each event to the part that owns it (``Pairs``, ``Incoming``,
``Outgoing``, ``Roster``, ``Sources``) and does what crosses them: a pair lost fails the
requests that need it. A message acts only on what belongs to the connection
it came on; anything else is dropped with a log line.
"""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from ..planner.expand import Layers
from . import actions as act
from . import wire
from .core import Out, Settings, log
from .incoming import Incoming
from .outgoing import Outgoing
from .pairs import Down, Pairs, Up
from .roster import Roster
from .sources import Sources

LINGER_MS = 500
"""How long a connection closed right after its last messages were queued keeps sending them."""
CUT_ALL = "this rank's driver fences every peer at once (capabilities.fence_cuts_all)"
"""Said by the requests a fence for another source cut (``Protocol._cut``)."""


class Protocol:
    """One rank's control plane, without I/O. See the module docstring."""

    def __init__(self, settings: Settings, *, group: str | None = None) -> None:
        self.s = settings
        self.out = Out()
        self.pairs = Pairs(settings, self.out)
        self.incoming = Incoming(settings, self.out, self.pairs)
        self.outgoing = Outgoing(settings, self.out)
        self.roster = Roster(settings, self.out, group)
        self.sources = Sources(settings, self.out, self.pairs, self.incoming, self.roster)
        self.last: float | None = None
        self.tick_s = min(settings.heartbeat_s / 4, 0.05)
        self._tick_at = 0.0  # the first timer runs at once
        self._paused_s = settings.dead_after_s - settings.heartbeat_s  # a longer gap: paused

    def start(self) -> list[act.Action]:
        """What the shell does first (open the group membership, if any)."""
        return self.out.take()

    def _enter(self, now: float) -> None:
        """Every entry point's first step: a gap since the last one means this rank was paused
        (SIGSTOP, a frozen VM) long enough for its decode ranks to declare it lost and reuse
        their slots: nothing more is written to them before a new handshake."""
        last, self.last = self.last, now
        self.outgoing.now = self.incoming.now = now
        if last is not None and now - last > self._paused_s and self.pairs.downs:
            why = (
                f"{self.s.where('prefill')} was paused for {now - last:.1f} s (dead_after_s="
                f"{self.s.dead_after_s}): its decode ranks may have declared it lost"
            )
            log.warning("%s: %s", self.s.address, why)
            self._lose_downs([(down, why) for down in self.pairs.downs.values()])

    def expect(
        self, handle: object, rid: str, spec: tuple[str, ...], slots: dict[str, np.ndarray],
        registration: int, skip: dict[str, int], now: float,
    ) -> list[act.Action]:  # fmt: skip
        self._enter(now)
        rec = self.incoming.expect(handle, rid, spec, slots, registration, skip, now)
        self.sources.resolve(rec, now)
        return self.out.take()

    def offer(self, handle: object, rid: str, now: float) -> list[act.Action]:
        self._enter(now)
        self.outgoing.offer(handle, rid, now)
        return self.out.take()

    def write(
        self, handle: object, slots: dict[str, np.ndarray], last: bool, layers: Layers,
        now: float,
    ) -> list[act.Action]:  # fmt: skip
        self._enter(now)
        self.outgoing.write(handle, slots, last, layers, now)
        return self.out.take()

    def abort(self, handle: object, now: float) -> list[act.Action]:
        self._enter(now)
        rec = self.incoming.recvs.get(handle.request_id)  # type: ignore[attr-defined]
        if rec is not None and rec.handle is handle:
            self.incoming.fail(rec, "abort", "aborted by the engine", None, now)
        else:
            self.outgoing.abort(handle)
        return self.out.take()

    def renew(self, rid: str, spec: tuple[str, ...], now: float) -> list[act.Action]:
        """Ask the sources to keep holding ``rid`` for another lease (sent after the handshake
        when the pair is new; dropped with a log line when it cannot be)."""
        self._enter(now)
        self.sources.renew(rid, spec, now)
        return self.out.take()

    def close(self, why: str, now: float) -> list[act.Action]:
        """Fail every open request on both sides. The shell runs on while ``draining`` (our
        writes end, our sources confirm their aborts), up to its limit, then ``goodbye``."""
        self._enter(now)
        for rec in [r for r in self.incoming.recvs.values() if r.error is None]:
            self.incoming.fail(rec, "closed", why, None, now)
        for srec in list(self.outgoing.sends.values()):
            self.outgoing.fail(srec, "closed", why)
        return self.out.take()

    def draining(self) -> bool:
        """A failed decode request still waits for a source to confirm it stopped writing."""
        return any(r.acks for r in self.incoming.recvs.values())

    def goodbye(self, why: str) -> list[act.Action]:
        """Report FAILED what still drains (the backend deregisters our memory next: nothing
        lands after that), say ``Bye`` to every peer and close every connection."""
        for rec in list(self.incoming.recvs.values()):
            rec.acks.clear()
            self.incoming.settle(rec)
        bye = wire.Bye(incarnation=self.s.incarnation, reason=why)
        for up in list(self.pairs.conns.values()):
            if not up.lost:
                self.out.send(up.conn, bye)
            self.out.add(act.Close(up.conn, LINGER_MS))
        self.pairs.conns.clear()
        for down in list(self.pairs.downs.values()):
            self.out.send(down.conn, bye)
        self.pairs.ups.clear()
        self.roster.leave()
        return self.out.take()

    def receive(self, conn: act.Conn, msg: wire.Message, now: float) -> list[act.Action]:
        """``msg`` arrived on ``conn``: it acts only on what belongs to that connection."""
        self._enter(now)
        kind = conn[0]
        if kind == "down":
            self._from_down(conn[1], msg, now)
        elif kind == "up":
            up = self.pairs.conns.get(conn)
            if up is None:
                log.info("%s: %s from a closed pair: dropped", self.s.address, type(msg).__name__)
            elif up.lost:  # only the answers to its aborts still count
                if isinstance(msg, wire.Fail | wire.AbortAck):
                    self.incoming.on_message(up, msg, now)
                self._reap(up)
            else:
                up.last_seen = now
                self._from_up(up, msg, now)
        elif kind == "group":
            self.sources.on_roster(conn, msg, now)
        elif kind == "member":
            self.roster.on_joined(msg)
        return self.out.take()

    def _from_down(self, ident: bytes, msg: wire.Message, now: float) -> None:
        if isinstance(msg, wire.Hello):
            old = self.pairs.downs.get(ident) or self.pairs.resumed(msg)
            if old is not None:
                self._lose_down(old, f"{old.where()} said Hello again: starting over")
            self.pairs.hello(ident, msg, now)
            return
        if isinstance(msg, wire.Join):
            self.roster.join(ident, msg, now)
            return
        if isinstance(msg, wire.Lookup):
            self.roster.lookup(ident, now)
            return
        down = self.pairs.downs.get(ident)
        if down is None:
            log.warning("%s: %s from a peer that never said Hello: dropped", self.s.address,
                        type(msg).__name__)  # fmt: skip
            return
        down.last_seen = now
        if isinstance(msg, wire.Ping):
            if msg.incarnation == down.place.incarnation:
                self.out.send(down.conn, wire.Pong(incarnation=self.s.incarnation))
        elif isinstance(msg, wire.Bye):
            self._lose_down(down, f"{down.where()} closed its session: {msg.reason}", bye=True)
        elif not (down.ready or (down.error is not None and isinstance(msg, wire.Request))):
            log.warning(
                "%s: %s from %s before its Welcome: dropped",
                self.s.address,
                type(msg).__name__,
                down.where(),
            )
        elif isinstance(msg, wire.Request):
            self.outgoing.request(down, msg, now)
        elif isinstance(msg, wire.Abort | wire.Fail):
            self.outgoing.remote_fail(down, msg)
        elif isinstance(msg, wire.Unpacked):
            self.outgoing.unpacked(down, msg)
        elif isinstance(msg, wire.Renew):
            self.outgoing.renew(msg.rids, now)
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped",
                self.s.address,
                type(msg).__name__,
                down.where(),
            )

    def _from_up(self, up: Up, msg: wire.Message, now: float) -> None:
        if isinstance(msg, wire.Welcome):
            if up.welcome is not None:
                log.warning("%s: a second Welcome from %s: dropped", self.s.address, up.address)
                return
            problem = self.pairs.welcome(up, msg)
            if problem is None:
                self.incoming.pair_ready(up, now)
                return
            stage, text = problem
            self.incoming.pair_failed(up, stage, text, bool(msg.error), now)
            # The claims just queued must still leave: closed at once, ZMQ drops them.
            self.pairs.drop_up(up, now, text, linger_ms=LINGER_MS)
        elif isinstance(msg, wire.Bye):  # before its Welcome too: it closed while connecting
            during = "" if up.ready else " during the handshake"
            why = f"{up.where() if up.ready else up.address} closed its session{during}"
            self._lose_up(up, f"{why}: {msg.reason}", "peer lost", now, gone=True)
        elif up.welcome is None:
            log.warning(
                "%s: %s from %s before its Welcome: dropped",
                self.s.address,
                type(msg).__name__,
                up.address,
            )
        elif isinstance(msg, wire.Pong):
            if msg.incarnation != up.welcome.incarnation:
                self._lose_up(up, f"{up.where()} restarted (new incarnation)", "peer lost", now)
        elif isinstance(msg, wire.Fail | wire.AbortAck):
            self.incoming.on_message(up, msg, now)
        elif isinstance(msg, wire.Written):
            self.incoming.completed(up, wire.tag_of(msg), now)
        elif isinstance(msg, wire.Poke):
            pass  # its arrival woke the shell, whose pass reads the notifications next
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped", self.s.address, type(msg).__name__, up.address
            )

    def notification(self, driver: str, data: bytes, now: float) -> list[act.Action]:
        """A driver notification from the peer ``driver`` (``backend:address``), after the
        data: counted only for the pair that holds that driver address."""
        self._enter(now)
        up = self.pairs.by_driver.get(driver)
        if up is None:
            log.warning("%s: notification from unknown driver %s: dropped", self.s.address, driver)
            return self.out.take()
        try:
            note = wire.decode_note(data)
        except ProtocolError as exc:
            log.warning("%s: notification from %s: %s", self.s.address, up.address, exc)
            return self.out.take()
        if isinstance(note, wire.Ended):
            self.incoming.ended(up, note)
        else:
            self.incoming.completed(up, note, now)
        return self.out.take()

    def connected(
        self, ident: bytes, peer: object, generation: int, error: str, now: float
    ) -> list[act.Action]:
        self._enter(now)
        self.pairs.connected(ident, peer, generation, error, now)
        return self.out.take()

    def fenced(self, source: str, error: str, endpoint: bytes, now: float) -> list[act.Action]:
        self._enter(now)
        lost = self.incoming.fenced(source, error, endpoint)
        if endpoint and not error and self.s.fence_cuts_all:
            for up in [u for u in self.pairs.ups.values() if u.endpoint != endpoint]:
                self._cut(up, lost or source, now)
        return self.out.take()

    def _cut(self, up: Up, lost: str, now: float) -> None:
        """A fence for ``lost`` cut ``up``'s links too (``fence_cuts_all``): fail what needs it,
        say Bye (it writes nothing more to us), and handshake anew with our new endpoint at
        its next request, without a backoff: it did nothing wrong."""
        why = f"{up.where()} was cut off with {lost}: {CUT_ALL}; its next request handshakes anew"
        log.warning("%s: %s", self.s.address, why)
        self.incoming.pair_cut(up, why, lost, now)
        if up.ready:
            self.out.send(up.conn, wire.Bye(incarnation=self.s.incarnation, reason=why))
        self.pairs.drop_up(up, now, why, linger_ms=LINGER_MS)
        self.pairs.backoff.pop(up.address, None)

    def write_ended(self, wid: int, error: str, now: float) -> list[act.Action]:
        return self.writes_ended([(wid, error, 0.0)], now)

    def writes_ended(self, ended: list[tuple[int, str, float]], now: float) -> list[act.Action]:
        """Writes left the driver (``error``: that one failed; then the time its post took)."""
        self._enter(now)
        for wid, error, post_s in ended:
            down = self.outgoing.write_ended(wid, error, post_s)
            if down is not None and down.peer is not None:
                self.out.add(act.Disconnect(down.peer))
        return self.out.take()

    def pump(self, rid: str, now: float) -> list[act.Action]:
        """A pack of ``rid`` finished: post what is ready."""
        self._enter(now)
        self.outgoing.pump(rid)
        return self.out.take()

    def disconnected(self, conn: act.Conn, now: float) -> list[act.Action]:
        """``conn``'s peer closed the connection: its process exited or its session closed,
        so it writes nothing more."""
        self._enter(now)
        up = self.pairs.conns.get(conn) if conn[0] == "up" else None
        if up is not None and up.lost:  # it writes nothing more: its aborts need no answer
            self.incoming.pair_gone(up, now)
            self._reap(up)
        elif up is not None and up.ready:
            why = f"{up.where()} closed its connection (its process exited or its session closed)"
            self._lose_up(up, why, "peer lost", now, gone=True)
        return self.out.take()

    def refused(self, conn: act.Conn, why: str, now: float) -> list[act.Action]:
        """``conn`` cannot be had (a key refused, an address that cannot be reached)."""
        self._enter(now)
        if conn[0] == "up" and (up := self.pairs.conns.get(conn)) is not None and not up.lost:
            self._lose_up(up, why, "handshake", now, gone=True)
        elif conn[0] == "group" and (group := self.roster.refused_group(conn)) is not None:
            self.roster.drop(group)
            self.sources.fail_group(group.address, why, now)
        else:
            log.error("%s: %s", self.s.address, why)
        return self.out.take()

    def timer(self, now: float) -> list[act.Action]:
        self._enter(now)
        self._tick_at = now + self.tick_s
        lost_ups, lost_downs = self.pairs.tick(now)
        for up, why, stage in lost_ups:
            self._lose_up(up, why, stage, now)
        self._lose_downs(lost_downs)
        for group, why in self.roster.tick(now):
            self.sources.fail_group(group.address, why, now)
        self.incoming.tick(now)
        for up in [u for u in self.pairs.conns.values() if u.lost]:
            self._reap(up)
        self.sources.tick(now)
        self.outgoing.tick(now)
        return self.out.take()

    def next_deadline(self) -> float:
        """When ``timer`` must run next (every ``tick_s`` at the latest, checking every part's
        deadlines): cheap enough to ask on every pass of a shell's loop."""
        return self._tick_at

    def deadlines(self) -> float:
        """The earliest deadline of any part (a simulator may jump the clock to it)."""
        return min(
            self.pairs.next_deadline(),
            self.roster.next_deadline(),
            self.incoming.next_deadline(),
            self.outgoing.next_deadline(),
        )

    def _lose_up(self, up: Up, why: str, stage: str, now: float, gone: bool = False) -> None:
        """A prefill rank is gone (dead, restarted, closed, unreachable, silent): tell it (it may
        only be paused: it must then write nothing more to us), fail what needs it."""
        log.warning("%s: %s", self.s.address, why)
        self.incoming.pair_lost(up, why, stage, gone, now)  # its Aborts leave before the Bye
        if up.ready and not gone:
            self.out.send(up.conn, wire.Bye(incarnation=self.s.incarnation, reason=why))
        self.pairs.drop_up(up, now, why, linger_ms=0 if gone else LINGER_MS, keep=not gone)
        self.roster.forget(up.address, now)
        self._reap(up)

    def _reap(self, up: Up) -> None:
        """Close a lost pair's connection once no failing request waits for its answer."""
        if not any(up.address in r.acks for r in self.incoming.recvs.values()):
            self.pairs.close(up, LINGER_MS)

    def _lose_downs(self, lost: list[tuple[Down, str]]) -> None:
        """Lose several decode ranks at once: each is marked lost before any request fails, as
        one request's staging given back wakes another's waiting chunk, which would post its
        rounds to a rank whose turn had not come yet (a paused prefill, resumed: they landed in
        staging its decode rank had taken back)."""
        for down, _ in lost:
            down.lost = True
        for down, why in lost:
            self._lose_down(down, why)

    def _lose_down(self, down: Down, why: str, bye: bool = False) -> None:
        """A decode rank is gone: fail its requests; disconnect once our writes to it ended."""
        log.warning("%s: %s", self.s.address, why)
        self.pairs.drop_down(down, why)
        if self.outgoing.down_lost(down, why, bye) and down.peer is not None:
            self.out.add(act.Disconnect(down.peer))
