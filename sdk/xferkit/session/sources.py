"""A decode request's sources: what ``expect`` named, resolved into session addresses.

A source may be a group address (``group+<address>``) whose roster is looked up
(``Roster``) before the request can open a pair with each rank it names; a
renewal for such a group waits for its roster too. This is the glue between
the roster and the requests (``Incoming``): it resolves a request when its
rosters come, fails it when a lookup does, and tries again what waits for a
pair that was backing off.

A request may fail while its roster is on its way (the engine aborts it, it
times out): FAILED at once on this side (it asked no one, nothing can land),
but the prefill ranks behind the group would wait out their own deadline for
a ``Request`` that never comes. So it still claims its place at every rank
once the roster names them: a ``Request`` with its root cause (``failed``), over
a pair opened for it, as ``Incoming.fail`` does for a pair mid-handshake; an
``offer`` there fails at once with the same text. A lookup that fails, or the
request's deadline, forgets the claim: then no rank behind the group heard of
the request either.
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
        self._owed(now)

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
        self._owed(now)

    def _owed(self, now: float) -> None:
        """Send the claims of requests that failed before their rosters came, to every rank
        they name, once all have come; forget them once a lookup or the deadline ended."""
        keep = []
        for rec in self.incoming.unresolved:
            known = self._rosters(rec.spec)
            if known is None or now > rec.deadline:
                continue
            if not known:
                keep.append(rec)
                continue
            got = self.roster.expand(rec.spec, now)  # every roster is in: nothing is asked
            if isinstance(got, tuple) and len(set(got)) == len(got):
                self._claim(rec, got, now)
        self.incoming.unresolved = keep

    def _rosters(self, spec: tuple[str, ...]) -> bool | None:
        """Whether every group ``spec`` names has its roster (False: one is on its way); None
        when a lookup ended without one, or it names no group."""
        groups = [self.roster.groups.get(a) for a in spec if a.startswith(GROUP)]
        if not groups or any(g is None for g in groups):
            return None
        return all(g is not None and g.roster is not None for g in groups)

    def _claim(self, rec: Recv, sources: tuple[str, ...], now: float) -> None:
        assert rec.error is not None
        claim = wire.Request(
            rid=rec.rid, gen=rec.gen, needed=False, slots={}, stage=rec.error.stage,
            failed=rec.error.args[0],
        )  # fmt: skip
        for address in sources:
            up = self.pairs.open_up(address, now)
            if up is None:  # backing off: it waits out its own deadline
                log.info("%s: %s backs off: not told of %r", self.s.address, address, rec.rid)
            elif up.ready:
                self.out.send(up.conn, claim)
            else:
                up.queued.append(claim)
