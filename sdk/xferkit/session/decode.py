"""The decode side: a ``Receive`` per request, counted complete from the plans.

``expect`` resolves its sources (group addresses through the roster), opens
a pair with each, proves with ``coverage`` which of them write into this rank,
and sends each one ``Request`` naming this rank's slots. A source is complete
when its completion tags (on the driver's notification, after the data, or a
``Written`` message) add up to the total its last one announced. A failing
request asks every source it named slots to for an ``AbortAck`` before it
reports FAILED, so its slots may then be reused.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PlanError, ProtocolError, XferError
from ..planner import coverage
from ..staging import FORCE, stage
from . import wire
from .core import Core, log, stage_text
from .handles import Receive, RequestError, State
from .handshake import Up
from .rounds import Inbound


class Source:
    """What a decode request still needs from one source rank, and the staging slice it may
    write rounds into (0: none; its chunks then go direct)."""

    __slots__ = ("claimed", "inbound", "rank", "seen", "slice", "total")

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.total = rank, 0, 0
        self.slice = 0
        self.inbound: dict[int, Inbound] = {}  # staged chunk -> its rounds, unpacked as they land
        self.claimed: dict[str, np.ndarray] = {}  # pool -> the request's slots a chunk named

    @property
    def complete(self) -> bool:
        return self.total > 0 and self.seen >= self.total


class Recv:
    """A decode request as the I/O thread tracks it."""

    def __init__(
        self, handle: Receive, gen: int, spec: tuple[str, ...], slots: dict, deadline: float
    ) -> None:
        self.handle = handle
        self.rid = handle.request_id
        self.gen = gen
        self.spec = spec  # as given to expect: session or group addresses
        self.sources: tuple[str, ...] = ()  # every source rank's session address, once resolved
        self.slots: dict[str, np.ndarray] = slots
        self.deadline = deadline
        self.needed: dict[str, Source] = {}
        self.requested: set[str] = set()
        self.started = False
        self.error: tuple[str, str, str | None] | None = None  # stage, text, peer
        self.acks: set[str] = set()
        self.drain_at = 0.0


class DecodeSide(Core):
    """Receives: starting them, counting completions, failing them after the sources drained."""

    def _on_expect(self, handle: Receive, spec: tuple[str, ...], slots: dict) -> None:
        self._gen += 1
        rec = Recv(handle, self._gen, spec, slots, time.monotonic() + self.request_timeout_s)
        self._recvs[rec.rid] = rec
        self._on_sources(rec)

    def _on_sources(self, rec: Recv) -> None:
        """Resolve, open and handshake ``rec``'s sources as far as possible, then start it.

        Called again (by a roster reply, a Welcome, the tick) until it starts."""
        if rec.started or rec.error is not None:
            return
        now = time.monotonic()
        if not rec.sources:
            got = self._expand(rec.spec, now)
            if got is None:
                return  # a group's roster is on its way
            if not isinstance(got, str) and len(set(got)) != len(got):
                got = f"the sources name a rank twice: {got}"
            if isinstance(got, str):
                self._fail_recv(rec, "handshake", got, None)
                return
            rec.sources = got
        for address in rec.sources:
            up = self._open_up(address, now)
            if isinstance(up, str):
                self._fail_recv(rec, "handshake", up, address)
                return
        self._try_start(rec)

    def _try_start(self, rec: Recv) -> None:
        """Send the Requests once every source has answered the handshake."""
        if rec.started or rec.error is not None or not rec.sources:
            return
        ups = [self._ups.get(a) for a in rec.sources]
        if not all(u is not None and u.ready for u in ups):
            return
        rec.started = True
        live = [u for u in ups if u is not None]
        key = tuple((u.address, u.welcome.incarnation if u.welcome else 0) for u in live)
        cov = self._coverage.get(key)
        if cov is None:
            try:
                cov = coverage([u.manifest for u in live if u.manifest is not None], self.manifest)
            except PlanError as exc:
                cov = exc
            if len(self._coverage) > 256:
                self._coverage.clear()
            self._coverage[key] = cov
        if isinstance(cov, PlanError):
            text = stage_text(rec.rid, "plan", f"decode rank {self.manifest.tp_rank}", str(cov))
            self._fail_recv(rec, "plan", text, None, formatted=True)
            return
        for i in cov.sources:
            u = live[i]
            assert u.welcome is not None
            src = rec.needed[u.address] = Source(u.welcome.tp_rank)
            if u.welcome.staging in FORCE and u.staged is None:
                force = FORCE[u.welcome.staging]
                u.staged = stage(
                    cov.plans[i],
                    descriptor_bytes=u.welcome.descriptor_bytes,
                    copy_cost=u.welcome.copy_cost,
                    force=force,
                )
            if u.staged is not None and u.staged.unpacks(rec.slots):
                src.slice = self._slices.take() or 0  # none free: this source writes direct
        lists = {p: s.tolist() for p, s in rec.slots.items()}
        for u in live:
            need = rec.needed.get(u.address)
            self._to_up(
                u,
                wire.Request(
                    rid=rec.rid,
                    gen=rec.gen,
                    dst_rank=self.manifest.tp_rank,
                    dst_size=self.manifest.tp_size,
                    needed=need is not None,
                    slots=lists,
                    registration=self.backend.generation,
                    staging=need.slice if need is not None else 0,
                    staging_bytes=self._slices.slice_bytes if need and need.slice else 0,
                    dst_stage=self.pp_rank,
                    dst_stages=self.pp_size,
                ),
            )
            rec.requested.add(u.address)
        rec.handle._move(State.WAITING)
        self._check_recv(rec)

    def _check_recv(self, rec: Recv) -> None:
        if rec.error is None and rec.started and all(s.complete for s in rec.needed.values()):
            self._release_slices(rec)
            self._done(rec.handle, self._recvs)

    def _release_slices(self, rec: Recv) -> None:
        """Return ``rec``'s staging: every write into it landed or was confirmed stopped."""
        for src in rec.needed.values():
            if src.slice:
                self._slices.give(src.slice)
                src.slice = 0
                src.inbound.clear()

    def _fail_recv(
        self,
        rec: Recv,
        stage: str,
        detail: str,
        peer: str | None,
        *,
        formatted: bool = False,
        quiet: frozenset[str] = frozenset(),
    ) -> None:
        """Fail ``rec`` with this root cause, once every source still writing confirmed it
        stopped (``Abort`` -> ``AbortAck``); sources in ``quiet`` are known to write nothing."""
        if rec.error is not None:
            rec.acks -= quiet
            self._settle_recv(rec)
            return
        text = detail if formatted else stage_text(rec.rid, stage, self.where("decode"), detail)
        rec.error = (stage, text, peer)
        rec.drain_at = time.monotonic()
        abort = wire.Abort(rid=rec.rid, gen=rec.gen, stage=stage, text=text)
        fail = wire.Fail(rid=rec.rid, gen=rec.gen, stage=stage, text=text)
        for address in rec.sources:
            up = self._ups.get(address)
            if up is None or address in quiet:
                continue
            if not up.ready:  # mid-handshake: told once the Welcome comes, so an offer there
                up.queued.append(fail)  # fails with this text rather than a lease timeout
            elif address in rec.requested:
                self._to_up(up, abort)
                rec.acks.add(address)
            else:  # it never heard of the request from us: tell it, nothing to wait for
                self._to_up(up, fail)
        self._settle_recv(rec)

    def _settle_recv(self, rec: Recv) -> None:
        if rec.error is None or rec.acks:
            return
        stage, text, peer = rec.error
        self._release_slices(rec)
        rec.handle._fail(RequestError(text, stage=stage, request_id=rec.rid, peer=peer))
        if self._recvs.get(rec.rid) is rec:
            del self._recvs[rec.rid]
            self._finish(rec.rid)

    def _on_renew(self, rid: str, spec: tuple[str, ...]) -> None:
        """Ask the sources to keep holding ``rid`` for another lease (sent after the
        handshake when the pair is new; dropped with a log line when it cannot be)."""
        now = time.monotonic()
        got = self._expand(spec, now)
        if got is None:
            for address in spec:
                group = self._groups.get(address)
                if group is not None and group.roster is None:
                    group.renewals.add(rid)
            return
        if isinstance(got, str):
            log.warning("%s: renewing %r: %s", self.address, rid, got)
            return
        msg = wire.Renew(rids=[rid])
        for address in got:
            up = self._open_up(address, now)
            if isinstance(up, Up):
                (self._to_up(up, msg) if up.ready else up.queued.append(msg))
            else:
                log.warning("%s: renewing %r with %s: %s", self.address, rid, address, up)

    # -- messages from prefill ranks -------------------------------------------------

    def _on_up_message(self, up: Up, msg: wire.Message) -> None:
        if isinstance(msg, wire.Welcome):
            self._on_welcome(up, msg)
        elif up.welcome is None:
            log.warning(
                "%s: %s from %s before its Welcome: dropped",
                self.address,
                type(msg).__name__,
                up.address,
            )
        elif isinstance(msg, wire.Pong):
            if msg.incarnation != up.welcome.incarnation:
                self._lose_up(up, f"{up.where()} restarted (new incarnation)")
        elif isinstance(msg, wire.Fail | wire.AbortAck):
            rec = self._recvs.get(msg.rid)
            if rec is None or rec.gen != msg.gen:
                log.info(
                    "%s: late %s for request %r from %s: dropped",
                    self.address,
                    type(msg).__name__,
                    msg.rid,
                    up.address,
                )
            elif isinstance(msg, wire.Fail):
                quiet = frozenset({up.address})
                self._fail_recv(rec, msg.stage, msg.text, up.address, formatted=True, quiet=quiet)
            else:
                rec.acks.discard(up.address)
                self._settle_recv(rec)
        elif isinstance(msg, wire.Written):
            self._completed(up, wire.tag_of(msg))
        elif isinstance(msg, wire.Bye):
            self._lose_up(up, f"{up.where()} closed its session: {msg.reason}")
        else:
            log.warning(
                "%s: unexpected %s from %s: dropped", self.address, type(msg).__name__, up.address
            )

    def _drain_notifications(self) -> None:
        try:
            notes = self.backend.notifications()
        except XferError as exc:
            log.warning("%s: draining notifications: %s", self.address, exc)
            return
        for note in notes:
            up = self._by_driver.get(note.peer)
            if up is None:
                log.warning(
                    "%s: a notification from unknown driver peer %s: dropped",
                    self.address,
                    note.peer,
                )
                continue
            try:
                tag = wire.decode_tag(note.message)
            except ProtocolError as exc:
                log.warning("%s: notification from %s: %s", self.address, up.address, exc)
                continue
            self._completed(up, tag)

    def _completed(self, up: Up, tag: wire.Tag) -> None:
        rec = self._recvs.get(tag.rid)
        if rec is None or rec.gen != tag.gen or rec.error is not None:
            log.info(
                "%s: late completion of request %r from %s: dropped",
                self.address,
                tag.rid,
                up.address,
            )
            return
        src = rec.needed.get(up.address)
        if src is None or src.rank != tag.src_rank:
            log.warning(
                "%s: completion of %r from %s, which it does not need: dropped",
                self.address,
                tag.rid,
                up.address,
            )
            return
        if tag.round is not None and not self._unpack(rec, up, src, tag.round):
            return
        src.seen += 1
        if tag.total:
            src.total = tag.total
        rec.handle._move(State.TRANSFERRING)
        self._check_recv(rec)

    def _unpack(self, rec: Recv, up: Up, src: Source, r: wire.Round) -> bool:
        """Scatter a staged round that landed in ``src``'s slice into the request's slots, and
        free its half; False (the request failed) for a round that matches nothing we offered."""
        inbound = src.inbound.get(r.chunk)
        problem = ""
        if inbound is None:
            try:
                inbound = src.inbound[r.chunk] = self._inbound(rec, up, src, r)
            except (PlanError, KeyError) as exc:
                problem = f"a staged chunk naming {exc}"
        if inbound is not None:
            if not 0 <= r.index < len(inbound.req.rounds):
                problem = f"round {r.index} of a chunk of {len(inbound.req.rounds)}"
            elif inbound.req.rounds[r.index].dst_bytes:
                if not src.slice or not inbound.landed(r.index, r.half):
                    problem = f"round {r.index} landing twice or in staging never offered"
                else:
                    msg = wire.Unpacked(rid=rec.rid, gen=rec.gen, chunk=r.chunk, index=r.index)
                    self._to_up(up, msg)
        if problem:
            detail = f"{up.where()} sent {problem}: nothing of it was unpacked"
            self._fail_recv(rec, "transfer", detail, up.address)
            return False
        return True

    def _inbound(self, rec: Recv, up: Up, src: Source, r: wire.Round) -> Inbound:
        """The rounds of a new staged chunk, cut as the prefill rank cut them; ``PlanError``
        for one naming slots outside the request, or slots another chunk named (a prefill's
        chunks move forward: an overlap is forged, and would unpack twice)."""
        if up.staged is None or up.welcome is None:
            raise PlanError("a round from a pair without staging")
        chunk = {}
        for pool, (first, count, sources) in r.at.items():
            dst = rec.slots[pool][first : first + count]
            claimed = src.claimed.get(pool)
            if claimed is None:
                claimed = src.claimed[pool] = np.zeros(rec.slots[pool].size, bool)
            pages = up.staged.plan.pages(pool) or (1, 1)
            if (
                dst.size != count
                or sources > count * pages[1]
                or claimed[first : first + count].any()
            ):
                raise PlanError(f"slots [{first}, +{count}) of pool {pool!r} from {sources}")
            claimed[first : first + count] = True
            # Only how many: the sources' slots are the prefill rank's to know.
            chunk[pool] = (np.zeros(sources, dtype=np.int64), dst)
        req = up.staged.expand(
            chunk,
            src_capacity=up.welcome.slice_bytes // 2,
            dst_capacity=self._slices.half if src.slice else 0,
            direct=False,
        )
        return Inbound(req, src.slice, self._slices.half, self._copier)
