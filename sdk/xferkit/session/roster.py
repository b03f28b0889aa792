"""Group bootstrap without HTTP: a prefill instance reached through one address.

Every session keeps the roster of its group: itself, plus the ranks that
``Join`` it (each rank of the instance passes ``group=`` the session address
of one rank, TP 0 of PP stage 0 by convention, and re-sends ``Join`` every
heartbeat; a member silent for ``dead_after_s`` leaves the roster). A place
(TP rank, stage) is held by the connection that joined it while that member
lives: another identity may take it only once the member is gone, and a Join
that does not fit the group is refused. A decode rank given
``group+<address>`` as a source asks that rank (``Lookup`` -> ``Roster``)
for every rank's session address, retries while the roster is incomplete,
and forgets the answer when one of its ranks is lost.
"""

from __future__ import annotations

from . import actions as act
from . import wire
from .core import Out, Settings, log

GROUP = "group+"
"""Prefix of a group address: ``group+<session address of the rank serving the roster>``."""


class Group:
    """A group address a decode rank resolves: the lookup in flight, then the answer."""

    def __init__(self, address: str, now: float) -> None:
        self.address = address
        self.conn: act.Conn = ("group", address[len(GROUP) :])
        self.roster: tuple[str, ...] | None = None
        self.asked_at = now
        self.retry_at = 0.0
        self.last = "no answer"
        self.renewals: set[str] = set()


class Roster:
    """Both ends of group bootstrap: serving a roster, joining one, looking one up."""

    def __init__(self, s: Settings, out: Out, group: str | None) -> None:
        self.s, self.out = s, out
        self.members: dict[tuple[int, int], tuple[wire.Join, bytes, float]] = {}
        self.groups: dict[str, Group] = {}
        self.member: act.Conn | None = None
        self.lost: dict[str, float] = {}  # ranks this session lost lately -> when
        self.joined_at = float("-inf")
        self.refused = ""
        if group is not None:
            self.member = ("member", group.removeprefix(GROUP))
            self.out.add(act.Open(self.member))

    # -- serving -----------------------------------------------------------------------

    def lookup(self, ident: bytes, now: float) -> None:
        s = self.s
        ranks = [wire.Member(s.address, s.manifest.tp_rank, s.pp_rank)] + [
            wire.Member(j.address, j.tp_rank, j.pp_rank)
            for j, _, seen in self.members.values()
            if now - seen <= s.dead_after_s
        ]
        ranks.sort(key=lambda m: (m.pp_rank, m.tp_rank))
        roster = wire.Roster(tp_size=s.manifest.tp_size, pp_size=s.pp_size, ranks=ranks)
        self.out.send(("down", ident), roster)

    def join(self, ident: bytes, msg: wire.Join, now: float) -> None:
        s = self.s
        me = (s.manifest.tp_rank, s.pp_rank)
        key = (msg.tp_rank, msg.pp_rank)
        old = self.members.get(key)
        error = ""
        if (msg.tp_size, msg.pp_size) != (s.manifest.tp_size, s.pp_size):
            error = (
                f"{msg.address} joined as TP {msg.tp_size} x PP {msg.pp_size}, but the group is "
                f"TP {s.manifest.tp_size} x PP {s.pp_size}"
            )
        elif key == me or msg.tp_rank >= msg.tp_size or msg.pp_rank >= msg.pp_size:
            error = f"{msg.address} joined as TP rank {msg.tp_rank} of PP stage {msg.pp_rank}"
        elif old is not None and old[1] != ident and now - old[2] <= s.dead_after_s:
            error = (
                f"{msg.address} joined as TP rank {msg.tp_rank} of PP stage {msg.pp_rank}, "
                f"which {old[0].address} holds"
            )
        else:
            if old is None or old[0].incarnation != msg.incarnation:
                log.info("%s: %s joined the group as %s", s.address, msg.address, key)
            self.members[key] = (msg, ident, now)
        if error:
            log.warning("%s: refused a group member: %s", s.address, error)
        self.out.send(("down", ident), wire.Joined(error=error))

    # -- joining -----------------------------------------------------------------------

    def on_joined(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.Joined) and msg.error != self.refused:
            self.refused = msg.error
            if msg.error:
                log.error("%s: the group refused this rank: %s", self.s.address, msg.error)

    # -- looking up ----------------------------------------------------------------------

    def expand(self, spec: tuple[str, ...], now: float) -> tuple[str, ...] | str | None:
        """The session addresses ``spec`` names, group addresses replaced by their ranks; None
        while a roster is on its way; or why it cannot be resolved."""
        out: list[str] = []
        pending = False
        for address in spec:
            if not address.startswith(GROUP):
                out.append(address)
                continue
            group = self.groups.get(address)
            if group is None:
                group = self.groups[address] = Group(address, now)
                self.out.add(act.Open(group.conn))
                self.out.send(group.conn, wire.Lookup())
            if group.roster is None:
                pending = True
            else:
                out += group.roster
        return None if pending else tuple(out)

    def drop(self, group: Group) -> None:
        if self.groups.get(group.address) is group:
            del self.groups[group.address]
        if group.roster is None:
            self.out.add(act.Close(group.conn))

    def on_roster(self, conn: act.Conn, msg: wire.Message, now: float) -> Group | None:
        """A lookup's answer; the group, once its roster is complete."""
        group = next((g for g in self.groups.values() if g.conn == conn), None)
        if group is None or not isinstance(msg, wire.Roster) or group.roster is not None:
            return None
        need = msg.tp_size * msg.pp_size
        self.lost = {a: t for a, t in self.lost.items() if now - t <= self.s.dead_after_s}
        gone = [m.address for m in msg.ranks if m.address in self.lost]
        if msg.error:
            group.last = msg.error
        elif len(msg.ranks) < need or len({(m.tp_rank, m.pp_rank) for m in msg.ranks}) < need:
            have = [(m.tp_rank, m.pp_rank) for m in msg.ranks]
            group.last = f"{len(msg.ranks)} of {need} ranks joined (TP, PP): {have}"
            group.retry_at = now + min(0.05, self.s.heartbeat_s / 4)
            return None
        elif gone:  # the server has not noticed yet: ask again until it has
            group.last = f"it still lists {gone}, which this rank lost"
            group.retry_at = now + min(0.05, self.s.heartbeat_s / 4)
            return None
        else:
            group.roster = tuple(m.address for m in msg.ranks)
        if group.roster is None:
            return None
        self.out.add(act.Close(group.conn))
        log.info("%s: group %s is %s", self.s.address, group.address, list(group.roster))
        return group

    def forget(self, address: str, now: float) -> None:
        """A rank was lost: rosters naming it are asked again by the next request (and an
        answer still naming it, again)."""
        if len(self.lost) < 4096:
            self.lost[address] = now
        for group in list(self.groups.values()):
            if group.roster is not None and address in group.roster:
                self.drop(group)

    def refused_group(self, conn: act.Conn) -> Group | None:
        return next((g for g in self.groups.values() if g.conn == conn), None)

    def tick(self, now: float) -> list[tuple[Group, str]]:
        """Re-join and re-ask what is due; the lookups that ran out of time, with why."""
        s = self.s
        if self.member is not None and now - self.joined_at >= s.heartbeat_s:
            self.joined_at = now
            join = wire.Join(
                incarnation=s.incarnation,
                address=s.address,
                tp_rank=s.manifest.tp_rank,
                tp_size=s.manifest.tp_size,
                pp_rank=s.pp_rank,
                pp_size=s.pp_size,
            )
            self.out.send(self.member, join)
        expired = []
        for group in list(self.groups.values()):
            if group.roster is not None:
                continue
            if now - group.asked_at > s.handshake_timeout_s:
                self.drop(group)
                why = (
                    f"group {group.address}: no complete roster within "
                    f"handshake_timeout_s={s.handshake_timeout_s} ({group.last})"
                )
                expired.append((group, why))
            elif group.retry_at and now >= group.retry_at:
                group.retry_at = 0.0
                self.out.send(group.conn, wire.Lookup())
        return expired

    def leave(self) -> None:
        if self.member is not None:
            self.out.add(act.Close(self.member))
            self.member = None
        for group in list(self.groups.values()):
            self.drop(group)

    def next_deadline(self) -> float:
        times = [self.joined_at + self.s.heartbeat_s] if self.member is not None else []
        for g in self.groups.values():
            if g.roster is None:
                times.append(g.retry_at or g.asked_at + self.s.handshake_timeout_s)
        return min(times, default=float("inf"))
