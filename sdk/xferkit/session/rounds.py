"""Staged chunks in flight: staging slices, and rounds through their two halves.

A Session registers one staging buffer with its backend and hands out fixed
slices, one per staged (chunk, peer) at a time, returned when the chunk ends in
any state. Each slice is used as two halves, so packing round k+1 (or
unpacking round k-1) overlaps the wire copy of round k. The source posts
round k into half ``k % 2`` of both sides once the round that last used
those halves has left its own half (its write completed) and been unpacked
from the destination's half (the destination said so). Both sides cut the
same rounds from the same plan, chunk and half sizes (``StagedPlan.expand``).
"""

from __future__ import annotations

from ..copier import Copier
from ..descriptors import Descriptors
from ..staging import StagedRequest


class Slices:
    """Fixed-size slices of one buffer; ``take`` returns None when all are out."""

    def __init__(self, base: int, size: int, slice_bytes: int) -> None:
        count = size // slice_bytes if slice_bytes else 0
        self.slice_bytes = slice_bytes
        self._free = [base + i * slice_bytes for i in range(count)][::-1]
        self._out: set[int] = set()

    @property
    def half(self) -> int:
        """Bytes one round may use of one side: half a slice."""
        return self.slice_bytes // 2

    def take(self) -> int | None:
        if not self._free:
            return None
        addr = self._free.pop()
        self._out.add(addr)
        return addr

    def give(self, addr: int) -> None:
        if addr in self._out:  # giving twice (failure racing completion) is harmless
            self._out.remove(addr)
            self._free.append(addr)


class Outbound:
    """The source side of one staged chunk to one destination rank."""

    def __init__(
        self, req: StagedRequest, src: int, dst: int, half: int, dst_half: int, copier: Copier
    ) -> None:
        self.req, self.src, self.dst, self.half, self.dst_half = req, src, dst, half, dst_half
        self.copier = copier
        self.next = 0  # the next round to post
        self.sent: set[int] = set()  # posted, write not yet complete (its source half in use)
        self.unpacking: set[int] = set()  # landed, not yet unpacked (its destination half)
        self.complete = 0  # rounds whose writes completed

    @property
    def rounds(self) -> int:
        return len(self.req.rounds)

    @property
    def finished(self) -> bool:
        """Every round written and, where the destination stages, unpacked."""
        return self.complete == self.rounds and not self.unpacking

    def ready(self) -> tuple[int, Descriptors] | None:
        """Pack the next round and return (index, wire copies), when both its halves are free."""
        k = self.next
        if k >= self.rounds or (k - 2) in self.sent or (k - 2) in self.unpacking:
            return None
        r = self.req.rounds[k]
        side = k % 2
        copies = r.expand(self.src + side * self.half, self.dst + side * self.dst_half)
        if len(copies.pack):
            self.copier.copy(copies.pack.src, copies.pack.dst, copies.pack.nbytes)
        self.next += 1
        self.sent.add(k)
        if r.dst_bytes:
            self.unpacking.add(k)
        return k, copies.wire

    def written(self, k: int) -> None:
        self.sent.discard(k)
        self.complete += 1

    def unpacked(self, k: int) -> None:
        self.unpacking.discard(k)


class Inbound:
    """The destination side of one staged chunk from one source rank: unpacks each round."""

    def __init__(self, req: StagedRequest, dst: int, half: int, copier: Copier) -> None:
        self.req, self.dst, self.half, self.copier = req, dst, half, copier
        self.done: set[int] = set()

    def landed(self, k: int) -> bool:
        """Unpack round ``k`` (its bytes are in half ``k % 2``); False for a round out of range
        or seen before (a buggy or hostile peer): nothing is copied then."""
        if not 0 <= k < len(self.req.rounds) or k in self.done:
            return False
        copies = self.req.rounds[k].expand(0, self.dst + (k % 2) * self.half)
        if len(copies.unpack):
            self.copier.copy(copies.unpack.src, copies.unpack.dst, copies.unpack.nbytes)
        self.done.add(k)
        return True

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.req.rounds)
