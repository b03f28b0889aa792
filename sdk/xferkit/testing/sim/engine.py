"""The simulated engine: requests from the seed, slots reused the moment that is allowed.

Each use of a request id spans one prefill instance's ranks (``offer``, then
the slots in chunks, the last with ``last=True``) and one decode instance's
ranks (``expect`` naming every rank of that prefill instance, or its group
address). Either side may come first; any rank may abort at any time; ids are
reused once every rank of their last use is terminal. An instance's slots go
back to its free list once every rank of the use is terminal there (or its
process died), and the next request may take them at once: exactly what an
engine is allowed to do, and what makes a late write land in someone else's
pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...session.roster import GROUP
from ...session.states import RequestError, State
from ..models import gdn_hybrid
from .hostile import PREFILL

LAYERS = len({spec.layer for spec in gdn_hybrid()})
"""The model's layers (the world's ``Reference``): a layer-wise chunk is written per group."""

if TYPE_CHECKING:
    from .world import Rank, World


@dataclass(eq=False)
class Handle:
    """One rank's handle on one use: what the core told it, in order."""

    request_id: str
    side: str
    rank: str
    inc: int
    use: Use
    began: float
    states: list[State] = field(default_factory=list)
    error: RequestError | None = None
    failing: RequestError | None = None
    finished: int = 0

    @property
    def terminal(self) -> bool:
        return bool(self.states) and self.states[-1] in (State.DONE, State.FAILED)


@dataclass(eq=False)
class Use:
    serial: int
    rid: str
    src: dict[str, list[int]]
    dst: dict[str, list[int]]
    chunks: list[dict[str, list[int]]]
    reused: bool = False
    decoy: bool = False  # fetched from the hostile prefill: decode ranks only, never written
    skip: int = 0  # the first KV pages the decode holds already: dst names only the rest
    layers: list[list[int]] | None = None  # each chunk written per group of layers, in order
    sources: tuple[str, ...] = ()  # what the decode ranks name: the ranks, or their group
    prefill: list[str] = field(default_factory=list)  # the instance serving it
    decode: list[str] = field(default_factory=list)  # the instance fetching it
    incs: dict[str, int] = field(default_factory=dict)  # rank -> its incarnation at the start
    handles: dict[str, Handle] = field(default_factory=dict)  # rank -> its handle
    settled: set[str] = field(default_factory=set)  # ranks whose part is over
    freed: set[str] = field(default_factory=set)  # sides whose slots went back


class Engine:
    def __init__(self, world: World) -> None:
        self.w = world
        c = world.config
        self.free = {  # per instance, by its first rank
            ranks[0]: {"kv": list(range(c.kv_slots)), "state": list(range(c.state_slots))}
            for ranks in (*world.instances, *world.decodes)
        }
        self.uses: list[Use] = []
        self.decoys: list[Use] = []  # requests the decode ranks fetch from the hostile prefill
        self.retired: list[str] = []  # ids whose last use is terminal everywhere

    def start(self) -> None:
        c, rng = self.w.config, self.w.rng
        for i in range(c.requests):
            self.w.at(rng.uniform(0.0, c.arrivals_s), self.begin, i)
        if "hostile" in c.faults:
            for i in range(rng.randint(0, 1)):
                self.w.at(rng.uniform(0.0, c.arrivals_s), self.decoy, i)

    def decoy(self, i: int) -> None:
        """A request every decode rank fetches from the hostile prefill (an engine told to by
        a router it trusts): it fails, within its deadlines, and touches nothing else."""
        decode = self.w.decodes[0]
        if any(len(self.free[decode[0]][p]) < 1 for p in ("kv", "state")):
            self.w.at(self.w.now + 1.0, self.decoy, i)
            return
        dst = {p: self._take(decode[0], p, 1) for p in ("kv", "state")}
        use = Use(100_000 + i, f"x{i}", {}, dst, [], decoy=True, freed={"prefill"}, decode=decode)
        use.incs = {n: r.incarnation for n, r in self.w.ranks.items()}
        self.decoys.append(use)
        for rank in decode:
            self.w.ranks[rank].memory.scrub(dst)
            self.w.at(self.w.now + self.w.rng.uniform(0, 0.05), self._expect, use, rank)

    def begin(self, i: int) -> None:
        rng = self.w.rng
        kv = rng.randint(1, 4)
        c = self.w.config
        # A prefix cache hit (drawn only when asked for: the other schedules stay as they were).
        held = rng.randint(1, kv - 1) if c.skip and kv > 1 and rng.random() < c.skip else 0
        want = {"kv": kv, "state": 1}
        need = {"kv": kv - held, "state": 1}
        ranks, decode = rng.choice(self.w.instances), rng.choice(self.w.decodes)
        if any(len(self.free[s[0]][p]) < n for s, w in ((decode, need), (ranks, want))
               for p, n in w.items()):  # fmt: skip
            self.w.at(self.w.now + 1.0, self.begin, i)  # no free slots yet
            return
        src = {p: self._take(ranks[0], p, n) for p, n in want.items()}
        dst = {p: self._take(decode[0], p, n) for p, n in need.items()}
        rid, reused = f"r{i}", False
        if "reuse" in self.w.config.faults and self.retired and rng.random() < 0.4:
            rid, reused = self.retired.pop(rng.randrange(len(self.retired))), True
        cut = sorted(rng.sample(range(1, kv), min(rng.randint(0, 2), kv - 1))) if kv > 1 else []
        bounds = [0, *cut, kv]
        chunks = [{"kv": src["kv"][a:b]} for a, b in itertools.pairwise(bounds)]
        chunks[-1]["state"] = src["state"]
        use = Use(len(self.uses) + 1, rid, src, dst, chunks, reused, prefill=ranks, decode=decode)
        use.skip = held
        if c.layered and rng.random() < c.layered:  # drawn only when asked for, as the skip
            order = rng.sample(range(LAYERS), LAYERS)
            cuts = sorted(rng.sample(range(1, LAYERS), rng.randint(0, LAYERS - 1)))
            use.layers = [order[a:b] for a, b in itertools.pairwise([0, *cuts, LAYERS])]
        grouped = rng.random() < self.w.config.groups
        use.sources = (f"{GROUP}{ranks[0]}",) if grouped else tuple(ranks)
        use.incs = {n: r.incarnation for n, r in self.w.ranks.items()}
        self.uses.append(use)
        for rank in decode:
            self.w.ranks[rank].memory.scrub(dst)
        t0 = self.w.now
        decode_first = rng.random() < 0.5
        for rank in decode:
            t = t0 + (0.0 if decode_first else rng.uniform(0.0, 2.0)) + rng.uniform(0, 0.05)
            self.w.at(t, self._expect, use, rank)
        for rank in ranks:
            t = t0 + (rng.uniform(0.0, 2.0) if decode_first else 0.0) + rng.uniform(0, 0.05)
            self.w.at(t, self._offer, use, rank)
        if "abort" in self.w.config.faults and rng.random() < self.w.config.abort_p:
            rank = rng.choice([*ranks, *decode])
            self.w.at(t0 + rng.uniform(0.0, 4.0), self._abort, use, rank)
        if "close" in self.w.config.faults and rng.random() < self.w.config.close_p:
            rank = rng.choice([*ranks, *decode])
            self.w.at(t0 + rng.uniform(0.0, 4.0), self.w.close_rank, rank)

    def _take(self, side: str, pool: str, n: int) -> list[int]:
        """Free slots, half of the time the ones freed last (an engine's free list is a
        stack: the slots a failed request gave back are the next request's)."""
        free, rng = self.free[side][pool], self.w.rng
        if rng.random() < 0.5:
            return [free.pop() for _ in range(n)]
        return [free.pop(rng.randrange(len(free))) for _ in range(n)]

    # -- engine calls, on a rank's current incarnation ----------------------------------

    def _handle(self, use: Use, rank: Rank, side: str) -> Handle | None:
        if not rank.alive or rank.closing or rank.incarnation != use.incs[rank.name]:
            return None  # its engine's calls went with the process or Session that had them
        if rank.name in use.handles:
            raise AssertionError(f"{rank.name} called twice for use {use.serial}")
        h = Handle(use.rid, side, rank.name, rank.incarnation, use, self.w.now)
        use.handles[rank.name] = h
        rank.handles.add(h)
        self.w.check.opened(h)
        return h

    def _first(self, use: Use, name: str, side: str) -> tuple[Rank, Handle] | None:
        """A rank's first call of ``use`` (later if its process is stopped; never, if that
        process or Session is gone): its handle, its slots offered from now on."""
        rank = self.w.ranks[name]
        if rank.paused_until > self.w.now and rank.alive:
            again = self._expect if side == "decode" else self._offer
            self.w.at(self.w.resumed(rank), again, use, name)
            return None
        h = self._handle(use, rank, side)
        if h is None:
            self.settle(use, name)
            return None
        h.states.append(State.HANDSHAKING if side == "decode" else State.WAITING)
        rank.memory.offered(use)
        return rank, h

    def _expect(self, use: Use, name: str) -> None:
        got = self._first(use, name, "decode")
        if got is None:
            return
        rank, h = got
        arrays = {p: np.asarray(s, dtype=np.int64) for p, s in use.dst.items()}
        sources = (PREFILL, *self.w.instances[0][1:]) if use.decoy else use.sources
        skip = {"kv": use.skip} if use.skip else {}
        self.w.call(rank, "expect", h, use.rid, sources, arrays, 1, skip)
        rec = rank.proto.incoming.recvs.get(use.rid)
        if rec is not None and rec.handle is h:  # its writes carry this claim's generation
            rank.memory.serials[use.rid, rec.gen] = use.serial
            if self.w.hostile is not None:  # resolved from a roster it held already
                self.w.named_hostile(rank)

    def _offer(self, use: Use, name: str) -> None:
        got = self._first(use, name, "prefill")
        if got is None:
            return
        rank, h = got
        self.w.call(rank, "offer", h, use.rid)
        t = self.w.now
        groups: list[list[int] | None] = [None] if use.layers is None else [*use.layers]
        for i, chunk in enumerate(use.chunks):
            for j, layers in enumerate(groups):  # a forward pass: each chunk's layers in turn
                t += self.w.rng.uniform(0.0, 0.3 / len(groups))
                last = i == len(use.chunks) - 1 and j == len(groups) - 1
                self.w.at(t, self._write, h, chunk, last, layers)

    def _write(
        self, h: Handle, chunk: dict[str, list[int]], last: bool, layers: list[int] | None = None
    ) -> None:
        rank = self.w.ranks[h.rank]
        if rank.incarnation != h.inc or not rank.alive or rank.closing:
            return
        if rank.paused_until > self.w.now:
            self.w.at(self.w.resumed(rank), self._write, h, chunk, last, layers)
            return
        if h.terminal:
            return  # an engine stops writing a request that ended (Session.write would raise)
        arrays = {p: np.asarray(s, dtype=np.int64) for p, s in chunk.items()}
        self.w.call(rank, "write", h, arrays, last, None if layers is None else frozenset(layers))
        c = self.w.config
        rng = self.w.rng
        if "pause" in c.faults and rng.random() < 0.05 * (1 + last):
            # Stopped between chunks (or, after the last, while its writes are in the driver),
            # long enough to be declared lost (the worst moment), and half of the time past
            # the decode ranks' drain bound, when they reuse the slots.
            low = c.dead_after_s if rng.random() < 0.5 else c.drain_s + 2 * c.dead_after_s
            seconds = rng.uniform(min(low, c.max_pause_s), c.max_pause_s)
            self.w.at(self.w.now + rng.uniform(0.0, 0.002), self.w.pause, rank.name, seconds)

    def _abort(self, use: Use, name: str) -> None:
        rank = self.w.ranks[name]
        h = use.handles.get(name)
        if h is None or rank.incarnation != h.inc or not rank.alive or rank.closing:
            return
        if rank.paused_until > self.w.now:
            self.w.at(self.w.resumed(rank), self._abort, use, name)
            return
        self.w.call(rank, "abort", h)

    # -- what the engine learns ---------------------------------------------------------

    def ended(self, h: Handle) -> None:
        """``h`` is terminal on its rank (or its process died): its slots may go back."""
        self.w.ranks[h.rank].memory.released(h)
        self.settle(h.use, h.rank)

    def settle(self, use: Use, rank: str) -> None:
        """``rank``'s part of ``use`` is over: its handle is terminal, its process died, or it
        never made its call (it was gone or closing then)."""
        use.settled.add(rank)
        for side, ranks in (("prefill", use.prefill), ("decode", use.decode)):
            if side in use.freed or not use.settled.issuperset(ranks):
                continue
            use.freed.add(side)
            for pool, got in (use.src if side == "prefill" else use.dst).items():
                self.free[ranks[0]][pool].extend(got)
        if len(use.freed) == 2 and not use.decoy:
            self.retired.append(use.rid)
