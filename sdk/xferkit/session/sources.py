"""A decode request's sources: what ``expect`` named, resolved into session addresses.

A source may be a group address (``group+<address>``) whose roster is looked up
(``Roster``) before the request can open a pair with each rank it names; a
renewal for such a group waits for its roster too. This is the glue between
the roster and the requests (``Incoming``): it resolves a request when its
rosters come, fails it when a lookup does, and tries again what waits for a
pair that was backing off.
"""

from __future__ import annotations

from . import actions as act
from . import wire
from .core import Out, Settings, log
from .incoming import Incoming
from .pairs import Pairs
from .recvs import Recv
from .roster import GROUP, Roster


class Sources:
    """Resolving the sources of the decode requests (see the module docstring)."""

    def __init__(
        self, s: Settings, out: Out, pairs: Pairs, incoming: Incoming, roster: Roster
    ) -> None:
        self.s, self.out, self.pairs, self.incoming, self.roster = s, out, pairs, incoming, roster

    def resolve(self, rec: Recv, now: float) -> None:
        got = None if rec.sources else self.roster.expand(rec.spec, now)
        self.incoming.open_sources(rec, got, now)

    def on_roster(self, conn: act.Conn, msg: wire.Message, now: float) -> None:
        """A lookup's answer came on ``conn``: resolve what waited for it."""
        group = self.roster.on_roster(conn, msg, now)
        if group is None:
            return
        for rec in [r for r in self.incoming.recvs.values() if group.address in r.spec]:
            self.resolve(rec, now)
        rids, group.renewals = group.renewals, set()
        for rid in rids:
            self.renew(rid, (group.address,), now)

    def fail_group(self, address: str, why: str, now: float) -> None:
        """The lookup of group ``address`` failed: so does every request waiting for it."""
        server = address[len(GROUP) :]
        for rec in list(self.incoming.recvs.values()):
            if address in rec.spec and not rec.sources and rec.error is None:
                self.incoming.fail(rec, "handshake", why, server, now)

    def renew(self, rid: str, spec: tuple[str, ...], now: float) -> None:
        """Ask the sources to keep holding ``rid`` for another lease (sent after the handshake
        when the pair is new; dropped with a log line when it cannot be)."""
        got = self.roster.expand(spec, now)
        if got is None:
            for address in spec:
                group = self.roster.groups.get(address)
                if group is not None and group.roster is None:
                    group.renewals.add(rid)
        elif isinstance(got, str):
            log.warning("%s: renewing %r: %s", self.s.address, rid, got)
        else:
            msg = wire.Renew(rids=[rid])
            for address in got:
                up = self.pairs.open_up(address, now)
                if up is None:
                    log.warning("%s: renewing %r: %s backs off", self.s.address, rid, address)
                elif up.ready:
                    self.out.send(up.conn, msg)
                else:
                    up.queued.append(msg)

    def tick(self, now: float) -> None:
        for rec in [r for r in self.incoming.recvs.values() if not r.started and r.error is None]:
            self.resolve(rec, now)  # a pair that was backing off may be tried now
