"""The simulated world: ranks running the real protocol core, one clock, one seeded scheduler.

``World`` owns every rank (prefill instances of TP x PP ranks, each
bootstrapping its group, and decode instances of TP ranks; each rank a
``Protocol`` with the same settings a Session gives it), a heap of timed
events, and the parts that stand in for I/O: the network, the driver, the
engine, a hostile peer and the invariant checker. Every event is one call
into one rank's core; its actions are carried out at once, exactly as the
shell does, and the checker runs after it. Time jumps from event to event,
so a simulated hour takes a second. Everything random comes from the seed.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable
from functools import cache, partial
from typing import Any

from ...copier import CPU
from ...session import actions as act
from ...session import wire
from ...session.core import DRAIN_S, Settings
from ...session.protocol import Protocol
from ..models import gdn_hybrid
from ..reference import Reference
from .config import DECODE_INSTANCES, INSTANCES, Config
from .driver import Driver, endpoint
from .engine import Engine, Handle
from .hostile import HOSTILE, PREFILL, Hostile
from .invariants import Checker, Violation
from .memory import Memory
from .network import Network
from .packer import Packs
from .trace import brief

HOSTILE_IDENT = HOSTILE.encode()

BACKLOG_S = 0.0005
"""When, after a rank resumes, its control thread reads what arrived while it was stopped."""


@cache
def reference(
    prefill_tp: int, decode_tp: int, kv: int, state: int, pp: int, dpp: int = 1, copy: int = 0
) -> Reference:
    """One model's memory per shape, reused by every schedule (each allocation scrubs its
    destination slots, so nothing a schedule left behind can pass for a later write); each
    decode instance writes its own ``copy`` (the same seed: the same source bytes)."""
    slots = {"kv": kv, "state": state}
    return Reference(gdn_hybrid(), src_tp=prefill_tp, dst_tp=decode_tp, src_pp=pp, dst_pp=dpp,
                     src_slots=slots, dst_slots=slots)  # fmt: skip


class Rank:
    """One rank: its memory (from the reference), its current incarnation's core and state."""

    def __init__(
        self, world: World, name: str, role: str, memory: Memory, instance: list[str]
    ) -> None:
        self.w, self.name, self.role, self.memory = world, name, role, memory
        self.instance = instance  # the ranks of its instance (the first serves its group)
        self.stage = memory.stage  # its pipeline stage
        self.driver_name = f"sim:{name}-drv"
        self.incarnation = 0
        self.alive = False
        self.closing = False
        self.paused_until = 0.0
        self.resumes_at = 0.0  # when its engine thread and data-plane worker run again
        self.offset = 0.0  # this rank's clock minus the world's
        self.handles: set[Handle] = set()
        self.proto: Protocol
        self.timer_version = 0
        self.timer_due = -1.0

    def local(self, now: float) -> float:
        return now + self.offset

    def start(self) -> None:
        w = self.w
        self.incarnation += 1
        self.alive, self.closing = True, False
        self.timer_due = -1.0
        self.handles = set()
        self.memory.clear()  # a new process: nothing of it is offered yet
        c = w.config
        settings = Settings(
            address=self.name,
            incarnation=w.rng.getrandbits(48),
            manifest=self.memory.manifest,
            pp_rank=self.stage,
            pp_size=c.prefill_pp if self.role == "prefill" else c.decode_pp,
            staging=c.staging,
            arena=self.memory.staging.arena(c.slice_bytes),
            copier=CPU,  # unpacks in the core's call, as a Session's; packs too, or
            runner=partial(w.packs.run, self) if c.packer else None,  # on its worker
            backend="sim",
            driver_name=self.driver_name,
            endpoint=endpoint(self.name, w.driver.epochs.get(self.name, 0)),
            fingerprint="sim",
            notifying=c.notifying,
            pokes=c.notifying,  # the simulated driver has no descriptor to wait on either
            fencing=c.fencing,
            fence_cuts_all=c.fencing and c.fence_cuts_all,
            ends_are_final=c.ends_final,
            max_unoffered=c.max_unoffered,
            heartbeat_s=c.heartbeat_s,
            dead_after_s=c.dead_after_s,
            handshake_timeout_s=c.handshake_timeout_s,
            request_timeout_s=c.request_timeout_s,
            lease_s=c.lease_s,
            drain_s=c.drain_s,
            rng=random.Random(w.rng.getrandbits(64)),
            clock=lambda: self.local(self.w.now),
            secret=w.rng.randbytes(16),
        )
        server = self.instance[0]
        joins = c.groups > 0 and self.role == "prefill" and self.name != server
        self.proto = Protocol(settings, group=server if joins else None)
        w.apply(self, self.proto.start())
        w.schedule_timer(self)


class World:
    """One schedule: build it from a seed and a ``Config``, ``run()`` it."""

    def __init__(self, seed: int, config: Config, *, trace: bool = False) -> None:
        self.seed, self.config = seed, config
        self.rng = random.Random(seed)
        self.now = 0.0
        self.steps = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.trace: list[str] | None = [] if trace else None
        self._awake_s = (config.dead_after_s - config.heartbeat_s) / 2  # the longest a core sleeps
        c = config
        self.refs = [
            reference(
                c.prefill_tp, c.decode_tp, c.kv_slots, c.state_slots, c.prefill_pp, c.decode_pp, k
            )
            for k in range(c.decode_instances)
        ]
        ref = self.refs[0]
        n = config.prefill_tp * config.prefill_pp
        self.instances = [[f"{x}{i}" for i in range(n)] for x in INSTANCES[: config.instances]]
        self.prefill = [name for ranks in self.instances for name in ranks]
        self.decodes = [
            [f"{x}{i}" for i in range(config.decode_tp * config.decode_pp)]
            for x in DECODE_INSTANCES[: config.decode_instances]
        ]
        self.decode = [name for ranks in self.decodes for name in ranks]
        self.ranks: dict[str, Rank] = {}
        self.claims: dict[tuple[str, str], set[str]] = {}  # (prefill, rid) -> who claimed first
        for k, ranks in enumerate(self.instances):
            for i, name in enumerate(ranks):
                memory = Memory(ref.srcs[i], "src", config.staging_bytes, k)
                self.ranks[name] = Rank(self, name, "prefill", memory, ranks)
        for k, ranks in enumerate(self.decodes):
            for i, name in enumerate(ranks):
                memory = Memory(self.refs[k].dsts[i], "dst", config.staging_bytes)
                self.ranks[name] = Rank(self, name, "decode", memory, ranks)
        self.net = Network(self)
        self.driver = Driver(self)
        self.engine = Engine(self)
        self.check = Checker(self)
        self.packs = Packs(self)
        self.hostile = Hostile(self) if "hostile" in config.faults else None

    # -- the scheduler ----------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def to(self, rank: Rank, t: float, method: str, *args: Any) -> None:
        """A call into ``rank``'s current core at ``t`` (later if it is stopped then; never, if
        its process is gone by then)."""
        self.at(t, self._to, rank, rank.incarnation, method, args)

    def _to(self, rank: Rank, inc: int, method: str, args: tuple[Any, ...]) -> None:
        if rank.incarnation != inc or not rank.alive:
            return
        if rank.paused_until > self.now:
            self.at(rank.paused_until + BACKLOG_S, self._to, rank, inc, method, args)
            return
        self.call(rank, method, *args)

    def resumed(self, rank: Rank) -> float:
        """When a stopped rank's engine thread and data-plane worker run again: before or
        after its control thread reads the backlog (``BACKLOG_S``), as threads race; once a
        pause, so that each thread's calls keep their order (an engine writes its chunks in
        order: drawn per call, they were reordered, and the prefill mapped them to the wrong
        slots)."""
        return max(rank.resumes_at, rank.paused_until)

    def deliver(self, rank: Rank, conn: tuple, msg: wire.Message) -> None:
        if rank.paused_until > self.now:
            t = rank.paused_until + BACKLOG_S
            self.at(t, self._to, rank, rank.incarnation, "receive", (conn, msg))
            return
        self.call(rank, "receive", conn, msg)

    def call(self, rank: Rank, method: str, *args: Any) -> None:
        """One event into ``rank``'s core, at its own clock; its actions are carried out."""
        if self.trace is not None:
            self.trace.append(f"{self.now:12.6f} {rank.name}#{rank.incarnation} {method}"
                              f" {brief(args)}")  # fmt: skip
        msg = args[1] if method == "receive" else None
        conn = args[0] if msg is not None else ("", b"")
        forged = conn[1] == PREFILL if conn[0] != "down" else conn[1].startswith(HOSTILE_IDENT)
        if forged and isinstance(msg, wire.Request):
            self.hostile_first(rank, args[0][1], msg.rid)
        join = msg if isinstance(msg, wire.Join) else None
        held = None if join is None else rank.proto.roster.members.get((join.tp_rank, join.pp_rank))
        actions = getattr(rank.proto, method)(*args, self.now + rank.offset)
        if actions:
            self.apply(rank, actions)
            self.check.connects(rank, actions)
        if join is not None:
            self.check.joined(rank, args[0][1], join, held)
        if isinstance(msg, wire.Roster) and self.hostile is not None:
            self.named_hostile(rank)
        self.schedule_timer(rank)
        if forged or self.steps % 8 == 0:  # what the hostile sends makes tables grow
            self.check.bounds(rank)

    def named_hostile(self, rank: Rank) -> None:
        """A roster that named the hostile prefill (in a lost member's place: no keys here)
        makes it a source of the requests it resolved, before any of them asks it anything:
        those ``rank`` resolved, on its arrival or from a roster it held already."""
        assert self.hostile is not None
        for rec in rank.proto.incoming.recvs.values():
            serial = rank.memory.serials.get((rec.rid, rec.gen))
            if serial is not None and PREFILL in rec.sources:
                self.hostile.asked.add(serial)

    def hostile_first(self, rank: Rank, ident: bytes, rid: str) -> None:
        """Note that the hostile peer's Request for ``rid`` reaches ``rank`` before an honest
        decode rank holds the place it claims there: it may then fail the request (claiming
        first is what a trusted key allows; invariant 7)."""
        down = rank.proto.pairs.downs.get(ident)
        if down is None:
            return
        rec = rank.proto.outgoing.sends.get(rid)
        holder = None if rec is None else rec.dsts.get((down.place.pp_rank, down.place.tp_rank))
        if holder is None or holder.down.ident == ident:
            self.claims.setdefault((rank.name, rid), set()).add(HOSTILE)

    def schedule_timer(self, rank: Rank) -> None:
        """The shell runs the core's timer by its deadlines, and often enough that the clock
        never looks stopped to the core (``Protocol._enter``); a timer already due sooner is
        kept (it runs, finds nothing due, and asks again)."""
        now, proto, offset = self.now, rank.proto, rank.offset
        floor = proto.next_deadline() - offset  # the earliest it could be due
        if now <= rank.timer_due <= max(floor, now + proto.tick_s):
            return  # due within the shell's own tick, or as soon as it may run: kept
        due = min(proto.deadlines() - offset, now + self._awake_s)
        due = max(due, floor)  # at most once a tick
        if now <= rank.timer_due <= due:
            return
        rank.timer_due = due
        rank.timer_version += 1
        self.at(due, self._timer, rank, rank.incarnation, rank.timer_version)

    def _timer(self, rank: Rank, inc: int, version: int) -> None:
        if version == rank.timer_version and rank.incarnation == inc and rank.alive:
            if rank.paused_until > self.now:
                self.at(rank.paused_until + BACKLOG_S, self._timer, rank, inc, version)
            else:
                rank.timer_due = -1.0
                self.call(rank, "timer")

    # -- carrying out a core's actions (what the shell does) ---------------------------

    def apply(self, rank: Rank, actions: list[act.Action]) -> None:
        for a in actions:
            if isinstance(a, act.Send):
                if isinstance(a.msg, wire.Request) and a.msg.staging:  # a slice offered
                    m = a.msg
                    rank.memory.offer_staging(m.rid, m.gen, m.staging, m.staging_bytes)
                self.net.send(rank, a.conn, a.msg)
            elif isinstance(a, act.Open):
                self.net.open(rank, a.conn)
            elif isinstance(a, act.Close):
                self.net.close(rank, a.conn, a.linger_ms)
            elif isinstance(a, act.Connect):
                self.driver.connect(rank, a)
            elif isinstance(a, act.Post):
                self.driver.post(rank, a)
            elif isinstance(a, act.Cancel):
                self.driver.cancel(rank, a.wid)
            elif isinstance(a, act.Fence):
                self.driver.fence(rank, a.source)
            elif isinstance(a, act.Move | act.Failing | act.Failed | act.Done | act.Finished):
                if self.trace is not None and isinstance(a, act.Failing | act.Failed | act.Done):
                    h = a.handle
                    why = "" if isinstance(a, act.Done) else f": {a.error}"
                    self.trace.append(f"{'':12} -> {type(a).__name__} <{h.side} {h.request_id}"
                                      f" use {h.use.serial}>{why}")  # fmt: skip
                h = self.check.told(rank, a)
                if h is not None and h.terminal:
                    self.engine.ended(h)

    # -- process faults ----------------------------------------------------------------

    def crash(self, name: str) -> None:
        rank = self.ranks[name]
        if not rank.alive:
            return
        self._gone(rank)
        self.at(self.now + self.rng.uniform(0.1, 10.0), self.restart, name)

    def restart(self, name: str) -> None:
        rank = self.ranks[name]
        if not rank.alive:
            rank.start()
            self.net.back(rank)

    def _gone(self, rank: Rank, graceful: bool = False) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.now:12.6f} {rank.name}#{rank.incarnation} gone")
        self.net.gone(rank, graceful)
        self.driver.gone(rank)
        rank.alive = False
        rank.paused_until = 0.0
        for h in list(rank.handles):
            if not h.terminal:
                self.engine.settle(h.use, h.rank)
        rank.handles = set()
        rank.memory.clear()

    def close_rank(self, name: str) -> None:
        """The engine closes the rank's Session: ``close``; the writes end and the sources
        confirm (up to the shell's ``DRAIN_S``); ``goodbye``."""
        rank = self.ranks[name]
        if not rank.alive or rank.closing:
            return
        if rank.paused_until > self.now:
            self.at(self.resumed(rank), self.close_rank, name)
            return
        rank.closing = True
        self.call(rank, "close", "closed by the engine")
        self.at(self.now + 0.01, self._goodbye, rank, rank.incarnation, self.now + DRAIN_S)

    def _goodbye(self, rank: Rank, inc: int, give_up: float) -> None:
        if rank.incarnation != inc or not rank.alive:
            return
        busy = self.driver.pending(rank) or rank.proto.draining()
        if rank.paused_until > self.now or (busy and self.now < give_up):
            self.at(max(rank.paused_until, self.now + 0.05), self._goodbye, rank, inc, give_up)
            return
        self.apply(rank, rank.proto.goodbye("closed by the engine"))
        self._gone(rank, graceful=True)
        self.at(self.now + self.rng.uniform(0.1, 5.0), self.restart, rank.name)

    def pause(self, name: str, seconds: float) -> None:
        rank = self.ranks[name]
        if rank.alive and self.now + seconds > rank.paused_until:
            rank.paused_until = self.now + seconds
            rank.resumes_at = rank.paused_until + self.rng.uniform(0.0, 2 * BACKLOG_S)

    def jump(self, name: str, seconds: float) -> None:
        self.ranks[name].offset += seconds

    # -- a whole schedule ---------------------------------------------------------------

    def faults(self) -> None:
        c, rng = self.config, self.rng
        names = [*self.prefill, *self.decode]
        end = c.arrivals_s + 10.0
        for _ in range(rng.randint(0, 3)):
            t, name = rng.uniform(0, end), rng.choice(names)
            kind = rng.choice(sorted({"pause", "crash", "clock", "partition"} & c.faults) or [""])
            if kind == "pause":
                self.at(t, self.pause, name, rng.uniform(0.01, c.max_pause_s))
            elif kind == "crash":
                self.at(t, self.crash, name)
            elif kind == "clock":
                self.at(t, self.jump, name, rng.uniform(0.01, 8.0))
            elif kind == "partition":
                a, b = rng.choice(self.prefill), rng.choice(self.decode)
                self.at(t, self.net.partition, a, b, t + rng.uniform(0.1, 12.0))

    def run(self) -> list[Violation]:
        quiet = logging.getLogger("xferkit.session")
        was, quiet.disabled = quiet.disabled, True  # thousands of schedules: no log lines
        try:
            return self._run()
        finally:
            quiet.disabled = was  # a later test in this process reads them again

    def _run(self) -> list[Violation]:
        for rank in self.ranks.values():
            rank.start()
        self.engine.start()
        self.faults()
        if self.hostile is not None:
            self.hostile.start()
        while self._heap and self.steps < self.config.max_steps:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.steps += 1
            fn(*args)
            self.check.step()
            if self.check.quiet():
                break
        self.check.finish()
        return self.check.violations
