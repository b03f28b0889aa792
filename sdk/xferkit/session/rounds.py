"""Staged chunks in flight: staging space, and rounds through their two halves.

A Session registers one staging buffer with its backend and hands out pieces
of it (``Arena``), each sized to what one staged (chunk, peer) needs and at
most ``staging_slice_bytes``, returned when the chunk ends in any state. Each
piece is used as two halves, so packing round k+1 (or unpacking round k-1)
overlaps the wire copy of round k. The source posts round k into half
``k % 2`` of both sides once the round that last used those halves has left
its own half (its write completed) and been unpacked from the destination's
half (the destination said so). Both sides cut the same rounds from the same
plan, chunk and capacities (``StagedPlan.expand``: half the slice size on the
source, half the offered piece on the destination); the chunks of one request
share the decode rank's piece, half by half (``Halves``).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..copier import Copier, copier_for
from ..descriptors import Descriptors
from ..errors import ArgumentError, XferError
from ..manifest import STAGING_POOL, Manifest, Region
from ..staging import StagedRequest


def copier_of(manifest: Manifest) -> Copier | None:
    """The local copier for the manifest's memory; None (no staging) where there is none."""
    kinds = {r.device for r in manifest.regions}
    try:
        return copier_for(kinds.pop()) if len(kinds) == 1 else None
    except XferError:
        return None


class Staging:
    """A Session's staging buffer and the manifest that advertises it after the engine's regions
    (so writes into it pass the same bounds checks as any).

    The buffer lives where the copier copies: host memory for ``cpu``, a torch
    allocation on ``cuda:N`` (a copy between a GPU's regions and host staging
    would cross PCIe twice, and its kernels could not reach pageable memory).
    """

    def __init__(self, manifest: Manifest, nbytes: int, device: str = "cpu") -> None:
        self.buffer, self.addr = _allocate(nbytes, device)
        self.size = nbytes
        self.manifest = manifest
        if nbytes:
            region = Region.from_array(self.buffer, pool=STAGING_POOL, name="staging", layer=0)
            self.manifest = Manifest(
                (*manifest.regions, region), manifest.tp_rank, manifest.tp_size, manifest.dropped
            )

    def arena(self, slice_bytes: int) -> Arena:
        size = self.size
        return Arena(self.addr if size else 0, size, slice_bytes if size else 0)


HOST_PAGE = 4096
HOST_OFFSET = 2048
"""Host staging starts this far past a page boundary. glibc's ``memcpy`` (``rep movsb``, for
pieces of a few KiB and more) runs at a third of its speed on this AMD EPYC when the
destination lies 1-31 bytes ahead of the source modulo 4 KiB; pools sit at 0 (page-aligned,
pinned or mapped), 16 (numpy) or 64 (torch) past a page, and whole pages staged keep
staging's offset, so half a page keeps every pack and unpack clear of it
(docs/performance.md)."""


def host_buffer(nbytes: int, offset: int = HOST_OFFSET) -> np.ndarray:
    """``nbytes`` of host memory starting ``offset`` bytes past a page, faulted in now rather
    than on the first request (``bench_placement.py`` places its others with it)."""
    raw = np.empty(nbytes + HOST_PAGE, dtype=np.uint8)
    skip = (offset - int(raw.ctypes.data)) % HOST_PAGE
    host = raw[skip : skip + nbytes]
    host[::HOST_PAGE] = 0
    return host


def _allocate(nbytes: int, device: str) -> tuple[Any, int]:
    """``nbytes`` of memory on ``device`` (faulted in on the host), and its address; an
    ``ArgumentError`` naming ``staging_bytes`` when the machine cannot hold it."""
    try:
        if device == "cpu" or not nbytes:
            host = host_buffer(nbytes)
            return host, int(host.ctypes.data)
        import torch  # only a device copier leads here, and it imported torch already

        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return gpu, int(gpu.data_ptr())
    except (MemoryError, ValueError, RuntimeError) as exc:  # torch's out of memory included
        raise ArgumentError(
            f"staging_bytes={nbytes}: cannot allocate that much on {device} "
            f"({type(exc).__name__}: {exc}); pass a smaller staging_bytes",
            subject=nbytes,
        ) from exc


ALIGN = 64  # staging pieces start on cache lines (a copy into one never shares a line)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """Pieces of one staging buffer, each as large as its chunk needs (first fit, aligned,
    at most ``slice_bytes``); ``take`` returns None while no gap holds one.

    Sized pieces let hundreds of small chunks stage at once where fixed slices of
    ``slice_bytes`` served a handful (a 20 KiB chunk held a 16 MiB slice).
    """

    def __init__(self, base: int, size: int, slice_bytes: int) -> None:
        self.slice_bytes = slice_bytes
        self.size = size - size % ALIGN if slice_bytes else 0
        self._gaps: list[tuple[int, int]] = [(base, self.size)] if self.size else []
        self._out: dict[int, int] = {}  # start -> length
        self.used = 0  # bytes handed out (an int: any thread may read it)

    @property
    def half(self) -> int:
        """Bytes one round may use of one side: half a slice."""
        return self.slice_bytes // 2

    @property
    def free(self) -> int:
        return sum(n for _, n in self._gaps)

    def take(self, nbytes: int) -> int | None:
        """The start of ``nbytes`` (rounded up to ``ALIGN``) of staging, or None."""
        n = aligned(max(nbytes, 1))
        if n > self.slice_bytes:
            return None
        for i, (start, length) in enumerate(self._gaps):
            if length >= n:
                if length == n:
                    del self._gaps[i]
                else:
                    self._gaps[i] = (start + n, length - n)
                self._out[start] = n
                self.used += n
                return start
        return None

    def give(self, start: int) -> None:
        """Return a piece (giving one twice, as a failure racing completion may, is
        harmless); neighbouring gaps merge, so a quiet arena is one gap again."""
        n = self._out.pop(start, None)
        if n is None:
            return
        self.used -= n
        gaps = self._gaps
        i = bisect.bisect(gaps, (start, 0))
        if i < len(gaps) and gaps[i][0] == start + n:  # the gap after
            n += gaps.pop(i)[1]
        if i and gaps[i - 1][0] + gaps[i - 1][1] == start:  # the gap before
            start, n = gaps[i - 1][0], gaps[i - 1][1] + n
            i -= 1
            gaps.pop(i)
        gaps.insert(i, (start, n))


class Halves:
    """The two halves of the slice a decode rank offered one source for one request: the
    chunks of that request take turns, a half at a time, until the decode rank unpacked it."""

    def __init__(self) -> None:
        self.busy: list[object] = [None, None]
        self.turn = 0

    def take(self, owner: object) -> int | None:
        """The next half, now held by ``owner``; None while it is still held."""
        h = self.turn
        if self.busy[h] is not None:
            return None
        self.busy[h] = owner
        self.turn ^= 1
        return h

    @property
    def free(self) -> bool:
        """Whether ``take`` would give a half now."""
        return self.busy[self.turn] is None

    def release(self, owner: object) -> None:
        for h in (0, 1):
            if self.busy[h] == owner:
                self.busy[h] = None


class Pending(Protocol):
    """A copy started elsewhere (a ``packer.Pack`` in the shell); its result
    may be when the copy began and ended, for the request's timeline."""

    def done(self) -> bool: ...
    def result(self) -> object: ...


Runner = Callable[[Descriptors], Pending]
"""Starts a pack copy elsewhere (the Session's pack worker) and returns its future."""


class Outbound:
    """The source side of one staged chunk to one destination rank.

    With ``run``, the next round's pack starts as soon as its halves are free and runs on
    the worker while this round is posted; without, ``ready`` packs in the calling thread.
    """

    def __init__(
        self,
        req: StagedRequest,
        src: int,
        dst: int,
        half: int,
        dst_half: int,
        halves: Halves,
        copier: Copier,
        run: Runner | None = None,
    ) -> None:
        self.req, self.src, self.dst, self.half, self.dst_half = req, src, dst, half, dst_half
        self.halves, self.copier, self.run = halves, copier, run
        self.rounds = len(req.rounds)
        self._lands = [bool(r.dst_bytes) for r in req.rounds]  # round k needs a decode half
        self.next = 0  # the next round to post
        self.sent: set[int] = set()  # posted, write not yet complete (its source half in use)
        self.unpacking: set[int] = set()  # landed, not yet unpacked (its destination half)
        self.complete = 0  # rounds whose writes completed
        # The round being packed: (index, destination half, wire copies, the pack's future).
        self.packing: tuple[int, int, Descriptors, Pending | None] | None = None
        self.packed: list[tuple[float, float]] = []  # (began, ended) of each pack since read

    @property
    def finished(self) -> bool:
        """Every round written and, where the destination stages, unpacked."""
        return self.complete == self.rounds and not self.unpacking

    @property
    def blocked(self) -> bool:
        """Nothing packing, and the next round cannot start until an event frees a half (its
        source half still on the wire, or the decode rank's next half taken): ``ready`` would
        do nothing."""
        k = self.next
        if self.packing is not None or k >= self.rounds:
            return False
        return (k - 2) in self.sent or (self._lands[k] and not self.halves.free)

    @property
    def needs_half(self) -> bool:
        """Nothing packing, and the next round lands in the decode rank's staging: it cannot
        start while the half whose turn it is is taken."""
        return self.packing is None and self.next < self.rounds and self._lands[self.next]

    def _start(self) -> None:
        """Claim the next round's halves and pack it, once its source half is free and, where
        it lands in staging, a destination half is."""
        k = self.next
        if self.packing is not None or k >= self.rounds or (k - 2) in self.sent:
            return
        r = self.req.rounds[k]
        h = 0
        if r.dst_bytes:
            got = self.halves.take((self, k))
            if got is None:
                return
            h = got
        copies = r.expand(self.src + (k % 2) * self.half, self.dst + h * self.dst_half, only="send")
        future = None
        if len(copies.pack):
            if self.run is None:
                self.copier.copy(copies.pack.src, copies.pack.dst, copies.pack.nbytes)
            else:
                future = self.run(copies.pack)
        self.packing = (k, h, copies.wire, future)

    def ready(self) -> tuple[int, int, Descriptors] | None:
        """The next packed round as (index, destination half, wire copies), its next one's
        pack started; None while nothing is packed. Raises what the copier raised."""
        self._start()
        if self.packing is None:
            return None
        k, h, wire, future = self.packing
        if future is not None:
            if not future.done():
                return None
            span = future.result()
            if isinstance(span, tuple):
                self.packed.append(span)
        self.packing = None
        self.next += 1
        self.sent.add(k)
        if self.req.rounds[k].dst_bytes:
            self.unpacking.add(k)
        self._start()  # packed while this round goes on the wire
        return k, h, wire

    def settle(self) -> None:
        """Wait for a pack in flight: until it ends it reads the source and writes staging."""
        if self.packing is not None and self.packing[3] is not None:
            with contextlib.suppress(Exception):  # the request already failed, or will
                self.packing[3].result()

    def written(self, k: int) -> None:
        if k in self.sent:
            self.sent.discard(k)
            self.complete += 1

    def unpacked(self, k: int) -> None:
        if k in self.unpacking:
            self.unpacking.discard(k)
            self.halves.release((self, k))


class Inbound:
    """The destination side of one staged chunk from one source rank: unpacks each round."""

    def __init__(self, req: StagedRequest, dst: int, half: int, copier: Copier) -> None:
        self.req, self.dst, self.half, self.copier = req, dst, half, copier
        self.done: set[int] = set()

    def landed(self, k: int, h: int) -> bool:
        """Unpack round ``k`` from half ``h``; False for a round out of range or seen before
        (a buggy or hostile peer): nothing is copied then."""
        if not 0 <= k < len(self.req.rounds) or h not in (0, 1) or k in self.done:
            return False
        copies = self.req.rounds[k].expand(0, self.dst + h * self.half, only="unpack")
        if len(copies.unpack):
            self.copier.copy(copies.unpack.src, copies.unpack.dst, copies.unpack.nbytes)
        self.done.add(k)
        return True

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.req.rounds)
