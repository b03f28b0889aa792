"""Incoming requests (the decode side): a ``Receive`` per request, counted complete from
the plans.

``expect`` resolves its sources (group addresses through the roster), opens a
pair with each, proves with ``coverage`` which of them write into this rank,
and sends each one a ``Request`` naming this rank's slots, which claims the
request's place on that pair. A source is complete when its completion tags
(on the driver's notification, after the data, or a ``Written`` message on
its connection) add up to the total its last one announced; completions and
failures count only from the sources the request named.

FAILED means no byte can land any more: a failing request asks every source
it named slots to for an ``AbortAck`` and reports FAILED once each answered
(and, where it said an ``Ended`` notification follows its bytes, that landed),
or the driver fenced a lost one (``Fence``), or, on a driver that cannot fence,
its connection closed (the process is gone), or the bound derived from the
source's own deadlines passed (its ``drain_s`` plus ``dead_after_s`` after the
abort). Until then the handle is draining: ``failing`` holds the root cause.
"""

from __future__ import annotations

from collections import deque

from ..errors import PlanError
from ..staging import FORCE, stage
from . import actions as act
from . import wire
from .core import Out, Settings, log, stage_text
from .coverages import Coverages
from .fences import Fences
from .pairs import Pairs, Up
from .recvs import Recv
from .states import RequestError, State
from .unpacking import Source, Unpacker


class Incoming:
    """Receives: starting them, counting completions, failing them once sources stopped."""

    def __init__(self, s: Settings, out: Out, pairs: Pairs) -> None:
        self.s, self.out, self.pairs = s, out, pairs
        self.recvs: dict[str, Recv] = {}
        self.gen = 0
        self.coverages = Coverages(s.manifest)
        self._waiting: deque[Recv] = deque()  # started, waiting for staging, oldest first
        self.fences = Fences()
        self.unpacker = Unpacker(s)
        self.unresolved: list[Recv] = []  # failed before a roster named its sources (sources.py)

    now = 0.0  # the time of the call in progress (set by the Protocol on every entry)

    def expect(
        self, handle: object, rid: str, spec: tuple[str, ...], slots: dict, registration: int,
        skip: dict[str, int], now: float,
    ) -> Recv:  # fmt: skip
        self.gen += 1
        deadline = now + self.s.request_timeout_s
        rec = Recv(handle, rid, self.gen, spec, slots, registration, deadline, skip)
        self.recvs[rid] = rec
        return rec

    def open_sources(self, rec: Recv, got: tuple[str, ...] | str | None, now: float) -> None:
        """Open and handshake ``rec``'s resolved sources (``got``: from the roster), then start
        it. Called again (by a roster reply, a Welcome, the tick) until it starts."""
        if rec.started or rec.error is not None:
            return
        if not rec.sources:
            if got is None:
                return  # a group's roster is on its way
            if not isinstance(got, str) and len(set(got)) != len(got):
                got = f"the sources name a rank twice: {got}"
            if isinstance(got, str):
                self.fail(rec, "handshake", got, None, now)
                return
            rec.sources = got
        for address in rec.sources:
            self.pairs.open_up(address, now)
        self.try_start(rec, now)

    def try_start(self, rec: Recv, now: float) -> None:
        """Send the Requests once every source has answered the handshake."""
        if rec.started or rec.error is not None or not rec.sources:
            return
        ups = [self.pairs.ups.get(a) for a in rec.sources]
        live = [u for u in ups if u is not None and u.ready]
        if len(live) < len(ups):
            return
        rec.started = True
        cov = self.coverages.of(live)
        if isinstance(cov, PlanError):
            text = stage_text(rec.rid, "plan", f"decode rank {self.s.manifest.tp_rank}", str(cov))
            self.fail(rec, "plan", text, None, now, formatted=True)
            return
        for i in cov.sources:
            u = live[i]
            assert u.welcome is not None
            src = rec.needed[u.address] = Source(u.welcome.tp_rank)
            if u.welcome.staging in FORCE and u.staged is None:
                u.staged = stage(
                    cov.plans[i],
                    descriptor_bytes=u.welcome.descriptor_bytes,
                    copy_cost=u.welcome.copy_cost,
                    force=FORCE[u.welcome.staging],
                )
            if u.staged is not None:
                src.offer = self.unpacker.offer(u.staged, rec.slots)
        self.unpacker.fit(rec.needed.values())
        if not any(src.offer for src in rec.needed.values()):
            self._request(rec, live)  # no staging to wait for (nor behind others that wait)
            return
        rec.waiting_since = now
        self._waiting.append(rec)
        self._serve()

    def _serve(self) -> None:
        """Give staging to started requests, oldest first, while it fits, and send their
        Requests; a request waits rather than have its sources go direct, the route the
        cost model priced worse (its deadline bounds the wait)."""
        while self._waiting:
            rec = self._waiting[0]
            if rec.error is not None or self.recvs.get(rec.rid) is not rec:
                self._waiting.popleft()
            elif self.unpacker.take(rec.needed.values()):
                self._waiting.popleft()  # first: what _request does may serve the next
                rec.staging_wait_s += self.now - rec.waiting_since
                self._request(rec)
            else:
                return

    def _request(self, rec: Recv, ups: list[Up] | None = None) -> None:
        """Send ``rec``'s Requests to ``ups``, or, after a wait for staging, its live sources."""
        if ups is None:
            got = [self.pairs.ups.get(a) for a in rec.sources]
            gone = [a for a, u in zip(rec.sources, got, strict=True) if u is None or not u.ready]
            if gone:  # its pair went while the request waited for staging
                why = f"source {gone[0]} went away while the request waited for staging"
                self.fail(rec, "peer lost", why, gone[0], self.now)
                return
            ups = [u for u in got if u is not None]
        packed = wire.pack_slots(rec.slots)
        for u in ups:
            need = rec.needed.get(u.address)
            request = wire.Request(
                rid=rec.rid,
                gen=rec.gen,
                needed=need is not None,
                slots=packed,
                registration=rec.registration,
                staging=need.slice if need is not None else 0,
                staging_bytes=need.offer if need and need.slice else 0,
                skip=rec.skip,
            )
            self.out.send(u.conn, request)
            rec.requested.add(u.address)
        self.out.move(rec.handle, State.WAITING)
        self._check(rec)

    def _check(self, rec: Recv) -> bool:
        """DONE once every source needed is complete; whether it is."""
        if rec.error is not None or not rec.started:
            return False
        for src in rec.needed.values():  # a loop, not all(): this runs on every completion
            if not src.complete:
                return False
        self._release_slices(rec)
        del self.recvs[rec.rid]
        self.out.routed(rec.handle, rec.routes, rec.timeline)
        self.out.done(rec.handle, rec.rid)
        return True

    def _release_slices(self, rec: Recv) -> None:
        """Return ``rec``'s staging: every write into it landed or was confirmed stopped."""
        if self.unpacker.give(rec.needed.values()):
            self._serve()

    def fail(
        self, rec: Recv, stage: str, detail: str, peer: str | None, now: float, *,
        formatted: bool = False, quiet: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        """Fail ``rec`` with this root cause; FAILED once every source still writing confirmed
        it stopped (``Abort`` -> ``AbortAck``). Sources in ``quiet`` are known to write
        nothing more (they said so, or their process is gone)."""
        if rec.error is not None:
            rec.acks -= quiet
            self.settle(rec)
            return
        if rec.started and not rec.requested:  # it waited for staging until now
            rec.staging_wait_s += now - rec.waiting_since
        text = detail if formatted else stage_text(rec.rid, stage, self.s.where("decode"), detail)
        rec.error = RequestError(text, stage=stage, request_id=rec.rid, peer=peer)
        self.out.failing(rec.handle, rec.error)
        abort = wire.Abort(rid=rec.rid, gen=rec.gen, stage=stage, text=text)
        claim = wire.Request(
            rid=rec.rid, gen=rec.gen, needed=False, slots={}, stage=stage, failed=text
        )
        if not rec.sources:  # its group's roster is on its way: told once it comes
            self.unresolved.append(rec)
        drain = 0.0
        for address in rec.sources:
            up = self.pairs.ups.get(address)
            if up is None or address in quiet:
                continue
            if not up.ready:  # mid-handshake: told once the Welcome comes, so an offer there
                up.queued.append(claim)  # fails with this text rather than a lease timeout
            elif address in rec.requested:
                self.out.send(up.conn, abort)
                rec.acks.add(address)
                assert up.welcome is not None
                drain = max(drain, up.welcome.drain_s)
            else:  # it never heard of the request from us: tell it, nothing to wait for
                self.out.send(up.conn, claim)
        rec.drain_until = now + drain + self.s.dead_after_s
        self.settle(rec)

    def settle(self, rec: Recv) -> None:
        if rec.error is None or rec.acks or rec.barriers:
            return
        self._release_slices(rec)
        if self.recvs.get(rec.rid) is rec:
            del self.recvs[rec.rid]
            self.out.routed(rec.handle, rec.routes, rec.timeline)
            self.out.failed(rec.handle, rec.error)

    # -- pairs coming and going ------------------------------------------------------

    def pair_ready(self, up: Up, now: float) -> None:
        for rec in [r for r in self.recvs.values() if up.address in r.sources]:
            self.try_start(rec, now)

    def pair_failed(self, up: Up, stage: str, text: str, remote: bool, now: float) -> None:
        """``up``'s handshake failed (``remote``: with the prefill rank's own text)."""
        waiting = [r for r in self.recvs.values() if up.address in r.sources and not r.started]
        me = self.s.where("decode")
        for rec in waiting:
            t = text if remote else stage_text(rec.rid, stage, me, text)
            claim = wire.Request(
                rid=rec.rid, gen=rec.gen, needed=False, slots={}, stage=stage, failed=t
            )
            self.out.send(up.conn, claim)  # so an offer there fails with the same text
        for rec in waiting:
            t = text if remote else stage_text(rec.rid, stage, me, text)
            self.fail(rec, stage, t, up.address, now, formatted=True, quiet=frozenset({up.address}))

    def pair_lost(self, up: Up, why: str, stage: str, gone: bool, now: float) -> None:
        """``up`` is lost; ``gone``: its connection closed, so it writes nothing more. A
        driver that fences cuts its connections instead, which proves more: a killed
        process's socket buffers still deliver (tests/hosts measured a megabyte)."""
        quiet = frozenset({up.address}) if gone and not self.s.fencing else frozenset()
        for rec in [r for r in self.recvs.values() if up.address in r.sources]:
            self.fail(rec, stage, why, up.address, now, quiet=quiet)
        if quiet:  # nor will the Ended it owed land
            self._stopped(up.address)
        if self.s.fencing and up.driver_name and self._waited_for(up.address):
            self.fences.ask(up.driver_name, up.address)
            self.out.add(act.Fence(up.driver_name))

    def pair_gone(self, up: Up, now: float) -> None:
        """A lost ``up``'s connection closed: its process is gone, nothing more lands (its
        fence settles what waits for it, where the driver fences)."""
        if not self.s.fencing:
            self._stopped(up.address)

    def fenced(self, source: str, error: str, endpoint: bytes) -> str | None:
        """The driver cut ``source``'s connections into our memory and gave a new endpoint
        for the next handshakes (``error``: it could not; what waited drains to its bound).
        The lost rank's address, when a fence was waited for."""
        if endpoint:
            self.pairs.renew(endpoint)
        address = self.fences.answered(source, error, self.now)
        if address is None:
            return None
        if error:  # asked again every REFENCE_S while it is waited for (the drain bound ends it)
            log.error("%s: fencing %s: %s", self.s.address, source, error)
            return None
        self._stopped(address)
        if self.s.fence_cuts_all:  # the fences still to come were for links it cut too
            for other in list(self.fences.pending()):
                self._stopped(other)
        return address

    def pair_cut(self, up: Up, why: str, lost: str, now: float) -> None:
        """``up``'s connections into our memory were cut by a fence for ``lost`` (a driver that
        fences every peer at once): its requests fail naming ``lost``, FAILED at once (nothing
        it sends can land any more); their Aborts tell it to stop."""
        for rec in [r for r in self.recvs.values() if up.address in r.sources]:
            self.fail(rec, "peer lost", why, lost, now)
        self._stopped(up.address)

    def _waited_for(self, address: str) -> bool:
        return any(r.waits_on(address) for r in self.recvs.values())

    def _stopped(self, address: str) -> None:
        for rec in [r for r in self.recvs.values() if r.waits_on(address)]:
            rec.acks.discard(address)
            rec.barriers.discard(address)
            self.settle(rec)

    # -- messages from prefill ranks -------------------------------------------------

    def _concerned(self, up: Up, msg: wire.Fail | wire.AbortAck | wire.Ended) -> Recv | None:
        """The request ``msg`` is about, if ``up`` was asked to write it (else None, logged)."""
        rec = self.recvs.get(msg.rid)
        if rec is None or rec.gen != msg.gen or up.address not in rec.requested:
            log.info(
                "%s: %s for request %r from %s, which it does not concern: dropped",
                self.s.address, type(msg).__name__, msg.rid, up.address,
            )  # fmt: skip
            return None
        return rec

    def on_message(self, up: Up, msg: wire.Fail | wire.AbortAck, now: float) -> None:
        if (rec := self._concerned(up, msg)) is None:
            return
        if msg.barrier and up.address not in rec.ended:  # its bytes' end is on its way
            rec.barriers.add(up.address)
        if isinstance(msg, wire.Fail):
            quiet = frozenset({up.address})
            self.fail(rec, msg.stage, msg.text, up.address, now, formatted=True, quiet=quiet)
        else:
            rec.acks.discard(up.address)
            self.settle(rec)

    def ended(self, up: Up, msg: wire.Ended) -> None:
        """``up``'s ``Ended`` notification landed: nothing it wrote for the request is still
        on the data path (it may come before the ``AbortAck`` or ``Fail`` announcing it)."""
        if (rec := self._concerned(up, msg)) is None:
            return
        rec.ended.add(up.address)
        rec.barriers.discard(up.address)
        self.settle(rec)

    def completed(self, up: Up, tag: wire.Tag, now: float) -> None:
        rec = self.recvs.get(tag.rid)
        if rec is None or rec.gen != tag.gen or rec.error is not None:
            log.info(
                "%s: late completion of %r from %s: dropped", self.s.address, tag.rid, up.address
            )
            return
        if up.address not in rec.requested:  # it cannot have written what it was not asked
            log.warning(
                "%s: completion of %r from %s before it was asked: dropped",
                self.s.address, tag.rid, up.address,
            )  # fmt: skip
            return
        src = rec.needed.get(up.address)
        if src is None or src.rank != tag.src_rank:
            log.warning(
                "%s: completion of %r from %s, which it does not need: dropped",
                self.s.address, tag.rid, up.address,
            )  # fmt: skip
            return
        rec.timeline.add("landed", now, now)
        if tag.round is not None and not self._unpack(rec, up, src, tag.round, now):
            return
        src.seen += 1
        if tag.total:
            src.total = tag.total
        if not self._check(rec) and not rec.transferring:
            rec.transferring = True
            self.out.move(rec.handle, State.TRANSFERRING)

    def _unpack(self, rec: Recv, up: Up, src: Source, r: wire.Round, now: float) -> bool:
        """Unpack a staged round; False (the request failed) for one matching nothing offered."""
        began = self.s.clock()
        problem, freed = self.unpacker.landed(rec.slots, up, src, r)
        if freed:  # it landed in staging and was unpacked from there
            rec.timeline.add("unpack", began, self.s.clock())
        if problem:
            detail = f"{up.where()} sent {problem}: nothing of it was unpacked"
            self.fail(rec, "transfer", detail, up.address, now)
            return False
        if freed:
            msg = wire.Unpacked(rid=rec.rid, gen=rec.gen, chunk=r.chunk, index=r.index)
            self.out.send(up.conn, msg)
        return True

    # -- timers ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for source, address in self.fences.due(now):
            if self._waited_for(address):
                self.fences.ask(source, address)
                self.out.add(act.Fence(source))
        for rec in list(self.recvs.values()):
            if rec.error is None and now > rec.deadline:
                why = f"not done within request_timeout_s={self.s.request_timeout_s}"
                self.fail(rec, "timeout", why, None, now)
            elif rec.error is not None and now > rec.drain_until:
                log.warning(
                    "%s: request %r: no abort confirmation from %s within their drain bound",
                    self.s.address, rec.rid, sorted(rec.acks | rec.barriers),
                )  # fmt: skip
                rec.acks.clear()
                rec.barriers.clear()
                self.settle(rec)

    def next_deadline(self) -> float:
        times = [r.drain_until if r.error is not None else r.deadline for r in self.recvs.values()]
        return min([*times, self.fences.next_deadline()])
