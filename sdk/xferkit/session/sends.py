"""What a prefill rank tracks per request: ``SendRec``, one ``Dst`` per decode place, and
the staged ``Chunk``s of each."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from ..descriptors import Descriptors
from ..errors import ProtocolError
from ..planner import Plan
from ..planner.expand import Layers
from . import wire
from .core import MAX_EARLY, MAX_UNOFFERED, MAX_UNOFFERED_SLOTS, remember
from .pairs import Down
from .rounds import Halves, Outbound
from .states import RequestError, Routes
from .timeline import Timeline

_NONE = np.zeros(0, dtype=np.int64)


class Chunk:
    """One staged chunk to one decode rank: its rounds and the piece of staging they pack
    into (``slice``, 0 until it has one; ``need``: its size, 0 when it packs nothing), and
    the request it was cut from (what a later chunk joins while none of it has started)."""

    __slots__ = ("at", "index", "layers", "need", "out", "request", "slice", "waiting_since")

    def __init__(
        self, index: int, out: Outbound, need: int, at: dict, layers: Layers,
        request: Mapping[str, tuple[np.ndarray, np.ndarray]],
    ) -> None:  # fmt: skip
        self.index, self.out, self.need, self.at, self.layers = index, out, need, at, layers
        self.request = request
        self.slice = 0
        self.waiting_since = 0.0


def unpack_slots(slots: dict[str, bytes]) -> dict[str, np.ndarray]:
    """A Request's packed slot indices as int64 arrays; ``ProtocolError`` for a ragged one."""
    out = {}
    for pool, raw in slots.items():
        if len(raw) % 4:
            raise ProtocolError(f"pool {pool!r}: {len(raw)} bytes of slot indices")
        out[pool] = np.frombuffer(raw, dtype=wire.SLOT).astype(np.int64)
    return out


Mapped = tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, tuple[int, int, int]]]
"""A chunk mapped onto one decode place: the request per pool and its (first, count, sources)."""


Spans = tuple[Mapping[str, tuple[np.ndarray, np.ndarray]], Mapping[str, tuple[int, int, int]]]


def joined(parts: Sequence[Spans]) -> Mapped | None:
    """Chunks mapped onto one decode place as one (the decode rank cuts the same rounds from
    the joined spans), when each one's spans continue those before it; None otherwise."""
    spans: dict[str, tuple[int, int, int]] = {}
    for _, at in parts:
        for pool, (first, count, sources) in at.items():
            had = spans.get(pool, (first, 0, 0))
            if had[0] + had[1] != first:
                return None
            spans[pool] = (had[0], had[1] + count, had[2] + sources)
    request: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for pool in spans:
        src, dst = zip(*(r[pool] for r, _ in parts if pool in r), strict=True)
        request[pool] = (np.concatenate(src), np.concatenate(dst))
    return request, spans


Written = tuple[dict[str, np.ndarray], bool, Layers]
"""A chunk as the engine wrote it: its slots per pool, whether it was the last, its layers."""


class Run(NamedTuple):
    """Chunks mapped onto one decode place to go as one: ``chunks`` of them, joined."""

    mapped: Mapped
    last: bool
    layers: Layers
    chunks: int


class Span:
    """A layer-wise chunk of one pool to one decode place: its slots, mapped once (None: all
    held there already, ``skip``), and the layers of the pool it still owes."""

    __slots__ = ("at", "every", "left", "raw", "request")

    def __init__(
        self, raw: np.ndarray, request: tuple[np.ndarray, np.ndarray] | None,
        at: tuple[int, int, int] | None, every: frozenset[int], written: frozenset[int],
    ) -> None:  # fmt: skip
        self.raw, self.request, self.at, self.every = raw, request, at, every
        self.left = every - written

    @property
    def complete(self) -> bool:
        return not self.left

    def more(self, raw: np.ndarray, layers: Layers, pool: str) -> str:
        """Take the next layers of this chunk; why not, if they cannot be."""
        if layers is None or not np.array_equal(raw, self.raw):
            return (
                f"a chunk of pool {pool!r} while layers {sorted(self.left)} of the layer-wise "
                "chunk before it are unwritten: write every layer of a chunk, with the same "
                "slots, before the next chunk"
            )
        twice = (layers & self.every) - self.left
        if twice:
            return f"layers {sorted(twice)} of pool {pool!r} written twice for the same slots"
        self.left = self.left - layers
        return ""


class Dst:
    """One decode place's part of a prefill request: bound to the connection that claimed it."""

    def __init__(self, down: Down, msg: wire.Request, slots: dict[str, np.ndarray]) -> None:
        self.down = down
        self.gen = msg.gen
        self.needed = msg.needed
        self.slots = slots
        self.cursor = dict.fromkeys(self.slots, 0)
        self.spans: dict[str, Span] = {}  # pool -> the layer-wise chunk whose layers still come
        self.held = msg.skip  # pool -> destination slots the decode rank holds already
        self.dropping: dict[str, int] = {}  # pool -> source slots still to drop for them
        self.seq = 0  # writes posted
        self.planned = 0  # writes posted or still to post (staged rounds): the total, once last
        self.last = False
        self.pending: dict[int, wire.Tag] = {}  # write id -> its tag, until the write ended
        self.staging, self.staging_bytes = msg.staging, msg.staging_bytes  # its slice for us
        self.chunks = 0
        self.staged: dict[int, Chunk] = {}
        self.halves = Halves()  # of its slice, shared by the staged chunks

    def take(
        self, slots: dict[str, np.ndarray], last: bool, plan: Plan, layers: Layers = None,
        every: Mapping[str, frozenset[int]] = MappingProxyType({}),
    ) -> Mapped | str:  # fmt: skip
        """Map a chunk's source slots onto this place's next unfilled slots: the request and
        each pool's (first, count, sources) span, or why the chunk cannot.

        A layer-wise chunk (``layers``) maps onto the slots the same chunk of every layer
        would; the pool's next chunk starts once every layer of it (``every[pool]``: this
        rank's) was written, each once, with the same source slots."""
        request: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        spans: dict[str, tuple[int, int, int]] = {}
        for pool, raw in slots.items():
            ratio = plan.pages(pool)  # None: no region of it here (another pipeline stage's)
            owed = every.get(pool, frozenset())
            if ratio is None or (layers is not None and not layers & owed):
                continue
            span = self.spans.get(pool)
            if span is not None:
                problem = span.more(raw, layers, pool)
                if problem:
                    return problem
                if span.request is not None and span.at is not None:
                    request[pool], spans[pool] = span.request, span.at
                    if span.complete:
                        self.cursor[pool] = span.at[0] + span.at[1]
                if span.complete:
                    del self.spans[pool]
                continue
            src, have, at = raw, self.slots.get(pool, _NONE), self.cursor.get(pool, 0)
            left = self._skipping(pool, ratio)
            if isinstance(left, str):
                return left
            if left:  # the first source slots fill what the destination holds already
                drop = min(left, src.size)
                src, self.dropping[pool] = src[drop:], left - drop
                if not src.size:  # all of it held there: so are the chunk's other layers
                    if layers is not None and not owed <= layers:
                        self.spans[pool] = Span(raw, None, None, owed, layers)
                    continue
            count, problem = _dst_count(src.size, ratio, last)
            room = have.size - at
            if not problem and count > room:
                problem = f"{self.down.where()} has {room} destination slots left"
                if count - room < ratio[0]:
                    count, problem = room, ""  # the last source slot's pages nobody asked for
            if problem:
                return f"a chunk names {src.size} slots of pool {pool!r}: {problem}"
            request[pool] = (src, have[at : at + count])
            spans[pool] = (at, count, src.size)
            if layers is not None and not owed <= layers:
                self.spans[pool] = Span(raw, request[pool], spans[pool], owed, layers)
            else:
                self.cursor[pool] = at + count
        if last and self.spans:
            p, span = next(iter(self.spans.items()))
            return (
                f"the last chunk leaves layers {sorted(span.left)} of pool {p!r} unwritten for "
                f"its last chunk's slots to {self.down.where()}"
            )
        if last:
            # Pools no region of this pair holds (another pipeline stage's) are not ours to fill.
            short = [
                p
                for p, s in self.slots.items()
                if self.cursor[p] != s.size and plan.pages(p) is not None
            ]
            if short:
                p = short[0]
                return (
                    f"the last chunk leaves {self.slots[p].size - self.cursor[p]} "
                    f"destination slots of pool {p!r} of {self.down.where()} unwritten"
                )
        return request, spans

    def take_runs(
        self, chunks: Iterable[Written], plan: Plan, every: Mapping[str, frozenset[int]]
    ) -> list[Run] | str:
        """Map chunks in order (``take``: each checked as written), joining runs of them without
        layers: those an engine wrote before this decode rank asked go as one. Why not, if one
        cannot be. The caller marks the place ``last`` as it writes the last run, not before."""
        groups: list[tuple[list[Mapped], bool, Layers]] = []
        for slots, last, layers in chunks:
            mapped = self.take(slots, last, plan, layers, every)
            if isinstance(mapped, str):
                return mapped
            if groups and layers is None and groups[-1][2] is None:
                groups[-1][0].append(mapped)
                groups[-1] = (groups[-1][0], last, None)
            else:
                groups.append(([mapped], last, layers))
        runs = []
        for parts, last, layers in groups:
            both = joined(parts) if len(parts) > 1 else parts[0]
            assert both is not None  # ``take`` moved each pool's cursor: each follows on
            runs.append(Run(both, last, layers, len(parts)))
        return runs

    def _skipping(self, pool: str, pages: tuple[int, int]) -> int | str:
        """Source slots of ``pool`` still to drop for the destination slots held there, or
        why the skip cannot be honoured (worked out at the pool's first chunk)."""
        if pool in self.dropping:
            return self.dropping[pool]
        n = self.held.get(pool, 0)
        ks, kd = pages
        if n * kd % ks:
            return (
                f"{self.down.where()} holds the first {n} destination slots of pool {pool!r} "
                f"already, which end inside a source slot (a source slot holds {ks} pages, a "
                f"destination slot {kd}): skip a whole number of source slots"
            )
        self.dropping[pool] = n * kd // ks
        return self.dropping[pool]


def _dst_count(n: int, pages: tuple[int, int], last: bool) -> tuple[int, str]:
    """Destination slots ``n`` source slots fill, or why a chunk cannot end there: a
    destination slot holding several source pages is written by one chunk, unless it is last."""
    ks, kd = pages
    count = -(-n * ks // kd)
    if n * ks % kd and not last:
        return count, (
            f"a destination slot holds {kd} source slots, so every chunk but the last names a "
            f"multiple of {kd}"
        )
    return count, ""


class SendRec:
    """A prefill request as the core tracks it."""

    def __init__(self, rid: str, deadline: float) -> None:
        self.rid = rid
        self.handle: object | None = None
        self.transferring = False  # its handle was told so (once: a move per write cost)
        self.dsts: dict[tuple[int, int], Dst] = {}  # (pipeline stage, TP rank) -> its part
        self.dst_size: tuple[int, int] | None = None  # decode (TP size, pipeline stages)
        self.chunks: list[Written] = []
        self.last = False
        self.deadline = deadline
        self.lease_until: float | None = None  # set while written, held and unclaimed
        self.error: RequestError | None = None
        self.held = 0  # slot indices held while not offered (bounded, all requests together)
        self.waiting = False  # counted among the requests not offered yet
        self.ack: Down | None = None  # once failing: the decode rank answered with AbortAck
        self.gone: Down | None = None  # once failing: the decode rank told nothing
        self.staging_wait_s = 0.0  # its chunks' waits for a piece of staging, summed
        self.staged = self.direct = 0  # its chunks (per decode place) by route
        self.staged_bytes = self.direct_bytes = 0
        self.descriptors = [0, 0]  # posted: direct, staged
        self.writes = 0  # posted
        self.timeline = Timeline()

    @property
    def routes(self) -> Routes:
        peers = tuple(sorted({d.down.place.address for d in self.dsts.values()}))
        return Routes(
            self.staged, self.direct, self.staging_wait_s, self.staged_bytes, self.direct_bytes,
            self.descriptors[1], self.descriptors[0], peers, self.writes,
        )  # fmt: skip

    def counted(self, direct: Descriptors, staged_bytes: int | None, chunks: int = 1) -> None:
        """Count ``chunks`` (joined) by their route: what they write direct, and through
        staging (None: they went direct)."""
        self.direct_bytes += direct.total_bytes
        if staged_bytes is None:
            self.direct += chunks
            return
        self.staged += chunks
        self.staged_bytes += staged_bytes

    @property
    def pending(self) -> bool:
        return any(d.pending for d in self.dsts.values())

    def dst_of(self, down: Down) -> Dst | None:
        """``down``'s part (a request has one per decode place)."""
        return next((d for d in self.dsts.values() if d.down is down), None)


class Ledger:
    """What a prefill rank remembers beyond a request's life: the ids finished here, the root
    causes of failures (before and after ``offer``), and the slots held for requests decode
    ranks asked for before the engine offered them (bounded: a peer cannot grow them)."""

    def __init__(self, max_unoffered: int = MAX_UNOFFERED) -> None:
        self.max_unoffered = max_unoffered  # a simulator shrinks it, so floods reach it
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.early: OrderedDict[str, RequestError] = OrderedDict()  # failed before offer()
        self.failed: OrderedDict[str, RequestError] = OrderedDict()
        self.held = 0  # slot indices held by requests not offered yet
        self.waiting = 0  # requests not offered yet

    def root_cause(self, rid: str) -> RequestError | None:
        return self.failed.get(rid) or self.early.get(rid)

    def failed_early(self, rid: str, error: RequestError) -> None:
        remember(self.early, rid, error, MAX_EARLY)

    def hold(self, rec: SendRec | None, count: int) -> str:
        """Hold ``count`` more slots for a request not offered yet (``rec`` None: a new one);
        why not, when that would pass a bound."""
        if (
            rec is None and self.waiting >= self.max_unoffered
        ) or self.held + count > MAX_UNOFFERED_SLOTS:
            return (
                f"{self.waiting} requests with {self.held} slots wait for offer() here "
                f"(MAX_UNOFFERED={self.max_unoffered}, MAX_UNOFFERED_SLOTS={MAX_UNOFFERED_SLOTS})"
            )
        return ""

    def keep(self, rec: SendRec, count: int) -> None:
        """``rec`` (not offered yet) holds ``count`` more slots."""
        rec.held += count
        self.held += count
        if not rec.waiting:
            rec.waiting = True
            self.waiting += 1

    def unhold(self, rec: SendRec) -> None:
        if rec.waiting:
            self.held -= rec.held
            self.waiting -= 1
            rec.held, rec.waiting = 0, False


def reused(rid: str) -> str:
    """Why a finished id is refused: one text for the offer and every decode rank asking."""
    return f"request id {rid!r} was already used with this prefill rank"


def refused_claim(rec: SendRec | None, down: Down, rid: str, finished: bool) -> str:
    """Why ``down``'s Request cannot claim its place in ``rid`` ("" when it can)."""
    shape = (down.place.tp_size, down.place.pp_size)
    if finished:
        return reused(rid)
    if rec is not None and (down.place.pp_rank, down.place.tp_rank) in rec.dsts:
        return f"request id {rid!r} was already used by {down.where()} (a second Request)"
    if rec is not None and rec.dst_size not in (None, shape):
        sizes = f"({rec.dst_size} and {shape})"
        return f"decode ranks disagree on their TP size x pipeline stages {sizes}"
    return ""


def stale(down: Down, msg: wire.Request) -> str:
    """Why a Request made after its rank re-registered is refused."""
    return (
        f"decode rank {down.place.tp_rank} re-registered its memory since the handshake "
        f"(registration {down.generation}, now {msg.registration}): the endpoint this "
        "rank holds is stale, so nothing is written through it"
    )


def rid_of(handle: object) -> str:
    return handle.request_id  # type: ignore[attr-defined, no-any-return]
