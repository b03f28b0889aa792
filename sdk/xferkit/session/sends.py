"""What a prefill rank tracks per request: ``SendRec``, one ``Dst`` per decode place, and
the staged ``Chunk``s of each."""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from . import wire
from .handles import RequestError
from .pairs import Down
from .rounds import Halves, Outbound


class Chunk:
    """One staged chunk to one decode rank: its rounds and the slice they pack into."""

    __slots__ = ("at", "index", "out", "slice")

    def __init__(self, index: int, out: Outbound, slice_: int, at: dict) -> None:
        self.index, self.out, self.slice, self.at = index, out, slice_, at


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
        self.seq = 0  # writes posted
        self.planned = 0  # writes posted or still to post (staged rounds): the total, once last
        self.last = False
        self.pending: dict[int, wire.Tag] = {}  # write id -> its tag, until the write ended
        self.staging, self.staging_bytes = msg.staging, msg.staging_bytes  # its slice for us
        self.chunks = 0
        self.staged: dict[int, Chunk] = {}
        self.halves = Halves()  # of its slice, shared by the staged chunks


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
        self.ack: Down | None = None  # once failing: the decode rank answered with AbortAck
        self.gone: Down | None = None  # once failing: the decode rank told nothing

    @property
    def pending(self) -> bool:
        return any(d.pending for d in self.dsts.values())

    def dst_of(self, down: Down) -> Dst | None:
        """``down``'s part (a request has one per decode place)."""
        return next((d for d in self.dsts.values() if d.down is down), None)
