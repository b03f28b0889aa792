"""What a prefill rank tracks per request: ``SendRec``, one ``Dst`` per decode place, and
the staged ``Chunk``s of each."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..descriptors import Descriptors
from ..errors import ProtocolError
from . import wire
from .core import MAX_EARLY, MAX_UNOFFERED, MAX_UNOFFERED_SLOTS, remember
from .pairs import Down
from .rounds import Halves, Outbound
from .states import RequestError, Routes
from .timeline import Timeline

_NONE = np.zeros(0, dtype=np.int64)


class Chunk:
    """One staged chunk to one decode rank: its rounds and the piece of staging they pack
    into (``slice``, 0 until it has one; ``need``: its size, 0 when it packs nothing)."""

    __slots__ = ("at", "index", "need", "out", "slice", "waiting_since")

    def __init__(self, index: int, out: Outbound, need: int, at: dict) -> None:
        self.index, self.out, self.need, self.at = index, out, need, at
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


class Dst:
    """One decode place's part of a prefill request: bound to the connection that claimed it."""

    def __init__(self, down: Down, msg: wire.Request, slots: dict[str, np.ndarray]) -> None:
        self.down = down
        self.gen = msg.gen
        self.needed = msg.needed
        self.slots = slots
        self.cursor = dict.fromkeys(self.slots, 0)
        self.skip: dict[str, int] = dict(msg.skip)  # destination slots held: see skipping()
        self.seq = 0  # writes posted
        self.planned = 0  # writes posted or still to post (staged rounds): the total, once last
        self.last = False
        self.pending: dict[int, wire.Tag] = {}  # write id -> its tag, until the write ended
        self.staging, self.staging_bytes = msg.staging, msg.staging_bytes  # its slice for us
        self.chunks = 0
        self.staged: dict[int, Chunk] = {}
        self.halves = Halves()  # of its slice, shared by the staged chunks

    def take(
        self,
        slots: dict[str, np.ndarray],
        last: bool,
        pages: Callable[[str], tuple[int, int] | None],
    ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, tuple[int, int, int]]] | str:
        """Map a chunk's source slots onto this place's next unfilled slots (``pages(pool)``:
        source and destination pages per slot, None for a pool no region of the pair holds):
        the request and each pool's (first, count, sources) span, or why the chunk cannot."""
        request: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        spans: dict[str, tuple[int, int, int]] = {}
        for pool, src in slots.items():
            have = self.slots.get(pool, _NONE)
            at = self.cursor.get(pool, 0)
            ratio = pages(pool)
            if ratio is None:  # no region of it here (another pipeline stage's): none of ours
                continue
            left = self._skipping(pool, ratio)
            if isinstance(left, str):
                return left
            if left:  # the first source slots fill what the destination holds already
                drop = min(left, src.size)
                src, self.skip[pool] = src[drop:], drop - left
                if not src.size:
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
            self.cursor[pool] = at + count
        if last:
            # Pools no region of this pair holds (another pipeline stage's) are not ours to fill.
            short = [
                p
                for p, s in self.slots.items()
                if self.cursor[p] != s.size and pages(p) is not None
            ]
            if short:
                p = short[0]
                return (
                    f"the last chunk leaves {self.slots[p].size - self.cursor[p]} "
                    f"destination slots of pool {p!r} of {self.down.where()} unwritten"
                )
            self.last = True
        return request, spans

    def _skipping(self, pool: str, pages: tuple[int, int]) -> int | str:
        """Source slots of ``pool`` still to skip, or why the skip cannot be honoured.

        ``skip`` holds the Request's count of destination slots (>= 0) until the first chunk
        naming the pool turns it into source slots still to skip (stored negated, <= 0).
        """
        n = self.skip.get(pool, 0)
        if n <= 0:
            return -n
        ks, kd = pages
        if n * kd % ks:
            return (
                f"{self.down.where()} holds the first {n} destination slots of pool {pool!r} "
                f"already, which end inside a source slot (a source slot holds {ks} pages, a "
                f"destination slot {kd}): skip a whole number of source slots"
            )
        return n * kd // ks


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
        self.dsts: dict[tuple[int, int], Dst] = {}  # (pipeline stage, TP rank) -> its part
        self.dst_size: tuple[int, int] | None = None  # decode (TP size, pipeline stages)
        self.chunks: list[tuple[dict[str, np.ndarray], bool]] = []
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
        self.timeline = Timeline()

    @property
    def routes(self) -> Routes:
        peers = tuple(sorted({d.down.place.address for d in self.dsts.values()}))
        return Routes(
            self.staged, self.direct, self.staging_wait_s, self.staged_bytes, self.direct_bytes,
            self.descriptors[1], self.descriptors[0], peers,
        )  # fmt: skip

    def counted(self, direct: Descriptors, chunk: Chunk | None) -> None:
        """Count a chunk by its route: what it writes direct, and through staging."""
        self.direct_bytes += direct.total_bytes
        if chunk is None:
            self.direct += 1
            return
        self.staged += 1
        self.staged_bytes += sum(max(r.src_bytes, r.dst_bytes) for r in chunk.out.req.rounds)

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


def rid_of(handle: object) -> str:
    return handle.request_id  # type: ignore[attr-defined, no-any-return]
