"""Group bootstrap without HTTP: a prefill instance reached through one address.

Every session keeps the roster of its group: itself, plus the ranks that
``Join`` it (each rank of the instance passes ``group=`` the session address
of one rank, TP 0 of PP stage 0 by convention, and re-sends ``Join`` every
heartbeat; a member silent for ``dead_after_s`` leaves the roster). A decode
rank given ``group+<address>`` as a source asks that rank once (``Lookup`` ->
``Roster``) for every rank's session address, retries while the roster is
incomplete, and forgets the answer when one of its ranks is lost, so the
next request asks again (a restarted rank has a new address).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from . import wire
from .core import Core, log

GROUP = "group+"
"""Prefix of a group address: ``group+<session address of the rank serving the roster>``."""


class Membership:
    """This rank's registration with the rank serving its group's roster."""

    def __init__(self, server: str, sock: zmq.Socket[Any]) -> None:
        self.server = server
        self.sock = sock
        self.sent_at = 0.0
        self.refused = ""


class Group:
    """A group address a decode rank resolves: the lookup in flight, then the answer."""

    def __init__(self, address: str, now: float) -> None:
        self.address = address
        self.server = address[len(GROUP) :]
        self.sock: zmq.Socket[Any] | None = None
        self.roster: tuple[str, ...] | None = None
        self.asked_at = now
        self.retry_at = 0.0
        self.last = "no answer"
        self.renewals: set[str] = set()


class Roster(Core):
    """Both ends of group bootstrap: serving a roster, joining one, looking one up."""

    # -- serving -----------------------------------------------------------------------

    def _on_roster_message(self, ident: bytes, msg: wire.Join | wire.Lookup) -> None:
        me = (self.manifest.tp_rank, self.pp_rank)
        if isinstance(msg, wire.Lookup):
            now = time.monotonic()
            ranks = [wire.Member(self.address, *me)] + [
                wire.Member(j.address, j.tp_rank, j.pp_rank)
                for j, seen in self._roster.values()
                if now - seen <= self.dead_after_s
            ]
            ranks.sort(key=lambda m: (m.pp_rank, m.tp_rank))
            roster = wire.Roster(tp_size=self.manifest.tp_size, pp_size=self.pp_size, ranks=ranks)
            self._to_down(ident, roster)
            return
        error = ""
        if (msg.tp_size, msg.pp_size) != (self.manifest.tp_size, self.pp_size):
            error = (
                f"{msg.address} joined as TP {msg.tp_size} x PP {msg.pp_size}, but the group is "
                f"TP {self.manifest.tp_size} x PP {self.pp_size}"
            )
        elif (msg.tp_rank, msg.pp_rank) == me or msg.pp_rank >= msg.pp_size:
            error = f"{msg.address} joined as TP rank {msg.tp_rank} of PP stage {msg.pp_rank}"
        else:
            key = (msg.tp_rank, msg.pp_rank)
            old = self._roster.get(key)
            if old is None or old[0].incarnation != msg.incarnation:
                log.info("%s: %s joined the group as %s", self.address, msg.address, key)
            self._roster[key] = (msg, time.monotonic())
        if error:
            log.warning("%s: refused a group member: %s", self.address, error)
        self._to_down(ident, wire.Joined(error=error))

    # -- joining -----------------------------------------------------------------------

    def _join(self, server: str) -> str | None:
        """Register with the rank serving the group's roster (re-sent every heartbeat); or
        why not."""
        sock = self._dealer(server.removeprefix(GROUP))
        if isinstance(sock, str):
            return sock
        member = self._membership = Membership(server, sock)
        self._watch(sock, lambda: self._on_joined(member))
        return None

    def _on_joined(self, member: Membership) -> None:
        for msg in self._messages(member.sock, member.server):
            if isinstance(msg, wire.Joined) and msg.error != member.refused:
                member.refused = msg.error
                if msg.error:
                    log.error("%s: the group refused this rank: %s", self.address, msg.error)

    def _leave_group(self) -> None:
        if self._membership is not None:
            self._unwatch(self._membership.sock)
            self._membership.sock.close(linger=0)
            self._membership = None
        for group in list(self._groups.values()):
            self._drop_group(group)

    # -- looking up ----------------------------------------------------------------------

    def _expand(self, spec: tuple[str, ...], now: float) -> tuple[str, ...] | str | None:
        """The session addresses ``spec`` names, group addresses replaced by their ranks; None
        while a roster is on its way; or why it cannot be resolved."""
        out: list[str] = []
        pending = False
        for address in spec:
            if not address.startswith(GROUP):
                out.append(address)
                continue
            group = self._groups.get(address)
            if group is None:
                group = self._groups[address] = Group(address, now)
                if (problem := self._ask(group)) is not None:
                    self._drop_group(group)
                    return problem
            if group.roster is None:
                pending = True
            else:
                out += group.roster
        return None if pending else tuple(out)

    def _ask(self, group: Group) -> str | None:
        if group.sock is None:
            sock = self._dealer(group.server)
            if isinstance(sock, str):
                return sock
            group.sock = sock
            self._watch(sock, lambda: self._on_roster(group))
        self._send(group.sock, wire.Lookup(), group.server)
        return None

    def _drop_group(self, group: Group) -> None:
        if self._groups.get(group.address) is group:
            del self._groups[group.address]
        if group.sock is not None:
            self._unwatch(group.sock)
            group.sock.close(linger=0)
            group.sock = None

    def _on_roster(self, group: Group) -> None:
        assert group.sock is not None
        for msg in self._messages(group.sock, group.server):
            if not isinstance(msg, wire.Roster) or group.roster is not None:
                continue
            need = msg.tp_size * msg.pp_size
            if msg.error:
                group.last = msg.error
            elif len(msg.ranks) < need:
                have = [(m.tp_rank, m.pp_rank) for m in msg.ranks]
                group.last = f"{len(msg.ranks)} of {need} ranks joined (TP, PP): {have}"
                group.retry_at = time.monotonic() + min(0.05, self.heartbeat_s / 4)
            else:
                group.roster = tuple(m.address for m in msg.ranks)
        if group.roster is None:
            return
        self._unwatch(group.sock)
        group.sock.close(linger=0)
        group.sock = None
        log.info("%s: group %s is %s", self.address, group.address, list(group.roster))
        for rec in list(self._recvs.values()):
            if group.address in rec.spec:
                self._on_sources(rec)
        for rid in group.renewals:
            self._on_renew(rid, (group.address,))
        group.renewals.clear()

    def _forget_group_of(self, address: str) -> None:
        """A rank was lost: rosters naming it are asked again by the next request."""
        for group in list(self._groups.values()):
            if group.roster is not None and address in group.roster:
                self._drop_group(group)

    def _tick_groups(self, now: float) -> None:
        member = self._membership
        if member is not None and now - member.sent_at >= self.heartbeat_s:
            member.sent_at = now
            join = wire.Join(
                incarnation=self.incarnation,
                address=self.address,
                tp_rank=self.manifest.tp_rank,
                tp_size=self.manifest.tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
            )
            self._send(member.sock, join, member.server)
        for group in list(self._groups.values()):
            if group.roster is not None:
                continue
            if now - group.asked_at > self.handshake_timeout_s:
                self._drop_group(group)
                why = (
                    f"group {group.address}: no complete roster within "
                    f"handshake_timeout_s={self.handshake_timeout_s} ({group.last})"
                )
                for rec in list(self._recvs.values()):
                    if group.address in rec.spec and not rec.sources and rec.error is None:
                        self._fail_recv(rec, "handshake", why, group.server)
            elif group.retry_at and now >= group.retry_at:
                group.retry_at = 0.0
                self._ask(group)
