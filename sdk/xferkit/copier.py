"""Same-process byte copies: how a staged transfer packs pieces into a staging buffer and back.

A staged transfer moves many small strided pieces (a head slice per token,
say) through one contiguous buffer, so the copy must cost numpy a few
statements per *group* of pieces, never Python per piece. Pieces are grouped
by length, and each side of a group is viewed over the raw memory it touches
(creating a view touches no memory): pieces at a constant stride are one
strided array, so a pack or unpack of every other row is a single
``np.copyto``; pieces on a grid of their own length are a contiguous array
that ``np.take`` gathers from; any others are a window whose overlapping rows
start every word, indexed per chunk of pieces.

The caller (the planner) guarantees the addresses are valid, destinations do
not overlap each other and no destination overlaps a source, so nothing here
re-checks them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final, Literal, NamedTuple, Protocol, get_args

import numpy as np

from .errors import CapabilityError
from .manifest import parse_device
from .rawmemory import raw_array

_CHUNK_BYTES: Final = 1 << 20
"""Bytes moved per indexing statement: temporaries stay in cache (about 2x faster than one go)."""

_MAX_LENGTHS: Final = 16
"""More distinct lengths than this and the rarest are split into power-of-two blocks..."""

_KEEP_LENGTHS: Final = 8
"""...keeping this many of the most common whole, so the groups stay few however lengths vary."""

_BLOCK: Final = 4096
"""Largest block a split piece is cut into: big enough that a row costs about a memcpy."""

_SCAN: Final = 1 << 17
"""Addresses checked per step when looking for a constant stride (1 MiB, cache-resident)."""

_SPREAD: Final = 4
"""Irregular pieces of at most this many items are indexed item by item, not row by row.

Measured on 16-byte items: 1.1-1.5x faster up to 4 items a piece, slower from 8.
"""

_WHOLE_MAX: Final = 1 << 30
"""Longest piece indexed as one numpy item (``_Side.whole``): numpy's void items end below
2 GiB, so longer pieces keep rows of 16-byte items."""

_ITEMS: Final[dict[int, np.dtype[Any]]] = {
    16: np.dtype(np.complex128),  # copied bit for bit: same-dtype copies never do arithmetic
    8: np.dtype(np.uint64),
    4: np.dtype(np.uint32),
    2: np.dtype(np.uint16),
    1: np.dtype(np.uint8),
}


class Copier(Protocol):
    """What a staged transfer copies through; a device-specific copier implements the same."""

    device: str

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``, for every ``i``."""
        ...


class CpuCopier:
    """Host memory copies, numpy alone."""

    device = "cpu"

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        copy_pieces(src, dst, nbytes)

    def __repr__(self) -> str:
        return "CpuCopier()"


CPU: Final = CpuCopier()


Using = Literal["numpy", "torch"]
USINGS: Final[tuple[Using, ...]] = get_args(Using)


def copier_for(device: str, *, using: Using | None = None) -> Copier:
    """The copier for memory on ``device``: numpy for ``cpu``, torch for ``cuda:N``.

    ``using="torch"`` asks for the torch copier on host memory too: the very
    code a CUDA copy runs, bar how a tensor is made over an address (so it is
    tested and measured without a GPU). A copier the build or machine lacks
    (no torch, no such CUDA device, numpy for device memory) is refused before
    anything is copied: a ``CapabilityError`` whose ``subject`` is the device.
    """
    try:
        kind, _ = parse_device(device)
    except ValueError as e:
        raise CapabilityError(f"no copier for device {device!r}: {e}", subject=device) from None
    if using is not None and (not isinstance(using, str) or using not in USINGS):
        raise CapabilityError(
            f"no copier for device {device!r} using {using!r}: use one of {USINGS} or None",
            subject=using,
        )
    if using == "numpy" and kind != "cpu":
        raise CapabilityError(
            f"no copier for device {device!r} using numpy: numpy reaches host memory only",
            subject=device,
        )
    if kind == "cpu" and using != "torch":
        return CPU
    from .torchcopier import TorchCopier  # imports torch itself, on first use

    return TorchCopier(device)


def copy_pieces(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (uint64 arrays).

    Internal: the addresses must be valid memory, destinations must not
    overlap each other nor any source (the planner proves it; nothing here
    checks). Python work is per distinct length and per MiB, never per piece.
    """
    for s, d, length in groups(src, dst, nbytes):
        _copy_group(s, d, length)


def groups(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """The pieces as (sources, destinations, length) groups of one length each, none empty.

    Each group keeps the caller's order; rare lengths are first split into blocks
    (``_split_rare``), so there are few groups however the lengths vary. Any
    copier shares this: only how one group is copied is its own.
    """
    src, dst, nbytes = (np.asarray(a, dtype=np.uint64).reshape(-1) for a in (src, dst, nbytes))
    if not len(src) == len(dst) == len(nbytes):
        raise ValueError(
            f"copy_pieces: {len(src)} sources, {len(dst)} destinations, {len(nbytes)} lengths"
        )
    if not len(nbytes):
        return
    first = int(nbytes[0])
    if _constant(nbytes, first):  # the usual case, without a sort
        if first:
            yield src, dst, first
        return
    shortest = int(nbytes.min())
    if shortest == 0:
        keep = nbytes != 0
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    lengths, counts = np.unique(nbytes, return_counts=True)
    if len(lengths) > _MAX_LENGTHS:
        src, dst, nbytes = _split_rare(src, dst, nbytes, lengths, counts)
        lengths, counts = np.unique(nbytes, return_counts=True)
    order = np.argsort(nbytes, kind="stable")  # groups by length, each in the caller's order
    ends = np.cumsum(counts).tolist()
    for length, start, end in zip(lengths.tolist(), [0, *ends], ends, strict=False):
        pick = order[start:end]
        yield src[pick], dst[pick], length


def _split_rare(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, lengths: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut pieces of rare lengths into ``_BLOCK``-byte blocks plus one block per bit of the rest.

    Every length then falls in a fixed set of at most 13 sizes, which bounds
    the groups (and so the Python loop) whatever the lengths are.
    """
    common = lengths[np.argsort(counts, kind="stable")[-_KEEP_LENGTHS:]]
    rare = ~np.isin(nbytes, common)
    s, d, n = src[rare], dst[rare], nbytes[rare]
    full = n // np.uint64(_BLOCK)
    tail = n % np.uint64(_BLOCK)
    bits = np.uint64(1) << np.arange(_BLOCK.bit_length() - 1, dtype=np.uint64)  # 1 .. BLOCK/2
    # Offsets: whole blocks first, then the tail's bits from the highest down.
    has = (tail[:, None] & bits[None, :]) != 0
    above = tail[:, None] & ~((bits << np.uint64(1)) - np.uint64(1))[None, :]
    base = full * np.uint64(_BLOCK)
    piece, bit = np.nonzero(has)
    tail_off = base[piece] + above[piece, bit]
    counts_full = full.astype(np.intp)
    owner = np.repeat(np.arange(len(n)), counts_full)
    first = np.cumsum(counts_full) - counts_full
    within = (np.arange(len(owner)) - np.repeat(first, counts_full)).astype(np.uint64)
    block_off = within * np.uint64(_BLOCK)
    out_src = np.concatenate([src[~rare], s[owner] + block_off, s[piece] + tail_off])
    out_dst = np.concatenate([dst[~rare], d[owner] + block_off, d[piece] + tail_off])
    out_n = np.concatenate([nbytes[~rare], np.full(len(owner), _BLOCK, dtype=np.uint64), bits[bit]])
    return out_src, out_dst, out_n


def _copy_group(src: np.ndarray, dst: np.ndarray, length: int) -> None:
    """Copy pieces that share one length: one strided copy, or a few statements per chunk."""
    s_span, d_span = _Span.of(src, length), _Span.of(dst, length)
    word = min(s_span.word, d_span.word)
    # A 16-byte item is a bit copy like any other, and numpy indexes it ~4x faster than two words.
    item = 16 if word == 8 and length % 16 == 0 else word
    s = _Side(src, s_span, word, item, read=True)
    d = _Side(dst, d_span, word, item, read=False)
    if s.addrs is None and d.addrs is None:  # both regular (a pack, unpack or block copy)
        np.copyto(d.view, s.view)
        return
    n, step = len(src), max(1, _CHUNK_BYTES // length)
    if not s.dense:  # overlapping rows: fancy indexing, through numpy's own temporary
        whole = s.per > _SPREAD and length <= _WHOLE_MAX
        s_view, d_view = (s.whole(length), d.whole(length)) if whole else (s.view, d.view)
        for i in range(0, n, step):
            d_view[d.index(i, i + step)] = s_view[s.index(i, i + step)]
        return
    # np.take (unbuffered: mode="clip", indices are in range) gathers ~1.6x faster than
    # indexing, straight into the destination when that is contiguous memory.
    direct = d.addrs is None and d.view.flags.c_contiguous
    staged = None if direct else np.empty((min(step, n), s.per), dtype=_ITEMS[item])
    for i in range(0, n, step):
        rows = s.rows(i, i + step)
        if staged is None:
            np.take(s.view, rows, axis=0, out=d.view[i : i + step], mode="clip")
        else:
            out = staged[: len(rows)]
            np.take(s.view, rows, axis=0, out=out, mode="clip")
            d.view[d.index(i, i + step)] = out


def _constant(values: np.ndarray, value: int) -> bool:
    """Whether every value equals ``value``, scanned in cache-sized runs (no big temporary)."""
    same = np.empty(min(len(values), _SCAN), dtype=bool)
    for i in range(0, len(values), _SCAN):
        run = values[i : i + _SCAN]
        if not np.equal(run, value, out=same[: len(run)]).all():
            return False
    return True


def _stride(addrs: np.ndarray, length: int) -> int | None:
    """The constant step between consecutive pieces (negative or zero too), if there is one."""
    if len(addrs) == 1:
        return length
    signed = addrs.view(np.int64)
    step = int(signed[1] - signed[0])
    steps = np.empty(min(len(signed) - 1, _SCAN), dtype=np.int64)
    # In cache-sized runs: an irregular side is usually told by its first run, and a regular
    # one costs two passes over cached memory instead of three over the whole array.
    for i in range(0, len(signed) - 1, _SCAN):
        n = min(_SCAN, len(signed) - 1 - i)
        np.subtract(signed[i + 1 : i + 1 + n], signed[i : i + n], out=steps[:n])
        if not _constant(steps[:n], step):
            return None
    return step


class _Span(NamedTuple):
    """What one side's addresses are: a constant stride, or a range and its low bits."""

    length: int
    word: int  # the widest word (8, 4, 2 or 1 bytes) dividing the length and every address
    stride: int | None
    lo: int = 0
    hi: int = 0  # one past the last byte
    grid: bool = False  # every piece starts a whole number of lengths past ``lo``

    @classmethod
    def of(cls, addrs: np.ndarray, length: int) -> _Span:
        stride = _stride(addrs, length)
        if stride is not None:
            return cls(length, _low_bit(int(addrs[0]) | abs(stride) | length), stride)
        signed = addrs.view(np.int64)
        lo, hi = int(signed.min()), int(signed.max()) + length
        ones = int(np.bitwise_or.reduce(signed))
        if length & (length - 1) == 0:  # a power of two: the low bits all equal lo's
            mask = length - 1
            grid = ones & mask == lo & mask == int(np.bitwise_and.reduce(signed)) & mask
        else:
            grid = all(
                not np.remainder(signed[i : i + _SCAN] - lo, length).any()
                for i in range(0, len(signed), _SCAN)
            )
        return cls(length, _low_bit(ones | length), None, lo, hi, grid)


def _low_bit(bits: int) -> int:
    """The widest word (8 bytes at most) dividing ``bits``."""
    bits |= 8
    return bits & -bits


class _Side:
    """One side's pieces as a view of ``item``-byte elements, and how a chunk of them is indexed.

    Pieces at a constant stride (end to end, every other row, ...) are a plain
    strided ``(n, per)`` view indexed by a slice. A source whose pieces all
    start a whole number of lengths apart is a contiguous ``(rows, per)``
    array over the span it touches, which ``np.take`` reads (``dense``).
    Others are a window over that span whose rows start every ``word`` bytes
    (rows overlap; no memory is touched), indexed by each piece's row: a 2-D
    window when pieces are long, or, when they hold at most ``_SPREAD`` items,
    a 1-D one indexed item by item, since numpy's per-row cost dominates
    short rows there.
    """

    __slots__ = ("addrs", "dense", "lo", "per", "shift", "skip", "unit", "view")

    def __init__(self, addrs: np.ndarray, span: _Span, word: int, item: int, read: bool) -> None:
        length = span.length
        self.per = length // item
        self.dense = read and span.grid
        self.addrs: np.ndarray | None = None
        if span.stride is not None:
            self.view = _raw(int(addrs[0]), (len(addrs), self.per), (span.stride, item), item)
            return
        self.addrs = addrs.view(np.int64)
        self.lo = span.lo
        size = span.hi - span.lo
        if self.dense:
            self.unit, self.skip = length, 0
            self.view = _raw(span.lo, (size // length, self.per), (length, item), item)
        elif self.per <= _SPREAD:
            self.unit, self.skip = word, item // word
            self.view = _raw(span.lo, ((size - item) // word + 1,), (word,), item)
        else:
            self.unit, self.skip = word, 0
            self.view = _raw(span.lo, ((size - length) // word + 1, self.per), (word, item), item)
        self.shift = self.unit.bit_length() - 1 if self.unit & (self.unit - 1) == 0 else -1

    def whole(self, length: int) -> np.ndarray:
        """This side's rows as one ``length``-byte item each (``per > _SPREAD``): indexed,
        numpy moves each piece with one memcpy where items of 16 bytes cost a loop step each
        (an unpack's scatter into pages under load: a sixth less CPU, docs/performance.md)."""
        v = self.view
        return raw_array(v.ctypes.data, (v.shape[0],), f"|V{length}", (v.strides[0],))

    def index(self, start: int, stop: int) -> slice | np.ndarray:
        """The chunk ``[start, stop)`` of pieces as this side's view is indexed."""
        return slice(start, stop) if self.addrs is None else self.rows(start, stop)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Where pieces ``[start, stop)`` of an irregular side sit in its view."""
        assert self.addrs is not None
        offsets = self.addrs[start:stop] - self.lo
        rows = offsets >> self.shift if self.shift >= 0 else offsets // self.unit
        if not self.skip:
            return rows
        out = np.empty((len(rows), self.per), dtype=np.int64)
        for k in range(self.per):  # column by column: broadcasting over a short axis is ~8x slower
            np.add(rows, k * self.skip, out=out[:, k])
        return out


def _raw(addr: int, shape: tuple[int, ...], strides: tuple[int, ...], item: int) -> np.ndarray:
    return raw_array(addr, shape, _ITEMS[item].str, strides)
