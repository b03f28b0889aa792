"""Byte copies, the unit every driver moves: three uint64 arrays, sealed when a plan made them."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ArgumentError
from .rawmemory import raw_array

if TYPE_CHECKING:
    from .manifest import Manifest


class Descriptors:
    """Byte copies: ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (uint64 arrays).

    They stay in the process that made them (a driver reads the arrays), so
    this is a plain container rather than a wire struct.

    Descriptors a ``Plan`` expanded are sealed: ``origin`` names the (source,
    destination) manifest pair they lie inside by construction, so a backend
    that registered that source manifest, writing to a peer that advertised
    that destination manifest, need not scan their bounds again (on a
    heterogeneous NHD request the scan costs several times the expansion).
    Their arrays live in immutable ``bytes``: no flag, view or base reachable
    from Python can make them writable, and replacing an array breaks the seal.
    """

    __slots__ = ("_seal", "dst", "nbytes", "src")

    def __init__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        nd = np.ndarray
        if not (  # one expression: made for every round of every chunk
            isinstance(src, nd) and isinstance(dst, nd) and isinstance(nbytes, nd)
            and src.dtype is _U64 and dst.dtype is _U64 and nbytes.dtype is _U64
            and src.ndim == dst.ndim == nbytes.ndim == 1 and src.size == dst.size == nbytes.size
        ):  # fmt: skip
            _check(src, dst, nbytes)
        self.src, self.dst, self.nbytes = src, dst, nbytes
        self._seal: tuple[Manifest, Manifest, tuple[np.ndarray, ...]] | None = None

    @property
    def origin(self) -> tuple[Manifest, Manifest] | None:
        """The manifest pair a plan expanded these for, while they are as it made them."""
        if self._seal is None:
            return None
        src, dst, arrays = self._seal
        current = (self.src, self.dst, self.nbytes)
        if any(a is not b or a.flags.writeable for a, b in zip(current, arrays, strict=True)):
            return None
        return src, dst

    @classmethod
    def sealed(cls, count: int, src: Manifest, dst: Manifest) -> Descriptors:
        """``count`` descriptors in immutable memory, bound to the manifests they lie in.

        The maker fills them once, inside ``filling()``, before handing them out.
        """
        raw = _new_bytes(None, 24 * count) if count else b""  # the three arrays, end to end
        whole = np.frombuffer(raw, dtype=np.uint64)
        if 24 * count >= _HUGEPAGES_FROM:
            _hugepages(_address(whole), whole.nbytes)
        arrays = (whole[:count], whole[count : 2 * count], whole[2 * count :])
        out = cls(*arrays)
        out._seal = (src, dst, arrays)
        return out

    @classmethod
    def sealed_copy(cls, whole: np.ndarray, src: Manifest, dst: Manifest) -> Descriptors:
        """Sealed descriptors from ``whole`` (src, dst and nbytes end to end, uint64), copied
        into immutable memory: for a small set, cheaper than ``sealed`` and ``filling``."""
        count = whole.size // 3
        if not count:
            return cls.sealed(0, src, dst)
        frozen = np.frombuffer(whole.astype(np.uint64, copy=False).tobytes(), dtype=np.uint64)
        arrays = (frozen[:count], frozen[count : 2 * count], frozen[2 * count :])
        out = cls(*arrays)
        out._seal = (src, dst, arrays)
        return out

    @contextlib.contextmanager
    def filling(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Writable aliases of a freshly sealed set's arrays, for its maker only."""
        n = len(self)
        whole = self.src.base
        assert isinstance(whole, np.ndarray) and whole.size == 3 * n
        alias = _alias(whole)
        yield alias[:n], alias[n : 2 * n], alias[2 * n :]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Descriptors):
            return NotImplemented
        return all(
            np.array_equal(a, b)
            for a, b in ((self.src, other.src), (self.dst, other.dst), (self.nbytes, other.nbytes))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Descriptors({len(self)} copies, {self.total_bytes} bytes)"

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def empty(cls) -> Descriptors:
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        if not isinstance(parts, Sequence) or not all(isinstance(p, Descriptors) for p in parts):
            raise ArgumentError(
                f"Descriptors.concat takes a sequence of Descriptors, not {parts!r:.80}"
            )
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )


_U64 = np.dtype(np.uint64)


def _check(src: object, dst: object, nbytes: object) -> None:
    """Three 1-D uint64 arrays of one length (a uint64 dtype that is not numpy's own object
    passes), else an ``ArgumentError`` naming the first that is not."""
    arrays = {"src": src, "dst": dst, "nbytes": nbytes}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype != _U64 or a.ndim != 1:
            what = f"{a.dtype} {a.ndim}-D array" if isinstance(a, np.ndarray) else type(a).__name__
            raise ArgumentError(f"Descriptors {name} must be a 1-D uint64 array, not a {what}")
    sizes = [a.size for a in arrays.values()]  # type: ignore[attr-defined]
    if len(set(sizes)) > 1:
        raise ArgumentError(
            f"Descriptors: {sizes[0]} sources, {sizes[1]} destinations, {sizes[2]} lengths"
        )


def merge_neighbours(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, apart: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each copy into the one before it where it continues that one on both sides.

    In the order given (sort first to merge more); the same arrays when nothing merges.
    ``apart`` (bools) marks copies that begin a descriptor whatever comes before them: the
    first of another region, where contiguous memory is not one registration.
    """
    if src.size < 2:
        return src, dst, nbytes
    start = np.ones(src.size, dtype=bool)
    start[1:] = (src[:-1] + nbytes[:-1] != src[1:]) | (dst[:-1] + nbytes[:-1] != dst[1:])
    if apart is not None:
        start |= apart
    idx = np.flatnonzero(start)
    if idx.size == src.size:
        return src, dst, nbytes
    return src[idx], dst[idx], np.add.reduceat(nbytes, idx).astype(np.uint64, copy=False)


def _alias(a: np.ndarray) -> np.ndarray:
    """A writable array over the memory of ``a`` (which lives in a ``bytes`` object).

    numpy refuses to make an array over ``bytes`` writable, whatever the caller
    does with its flags or bases; the maker writes through this alias once,
    before anything else can see the bytes (never a shared empty singleton:
    an empty set has nothing to write).
    """
    if not a.size:
        return np.empty(0, dtype=np.uint64)
    return raw_array(_address(a), (a.size,), "<u8")


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize  # uninitialised: filled by the maker
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]

_MADV_HUGEPAGE = 14
_madvise: Any = None
with contextlib.suppress(OSError, AttributeError):  # not Linux: no advice, just more faults
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


_HUGEPAGES_FROM = 1 << 22
"""Bytes from which a sealed set is worth advising into huge pages (a few of them)."""


def _hugepages(addr: int, size: int) -> None:
    """Ask for huge pages before first touch, as numpy does for its large arrays (fewer faults)."""
    page = 1 << 21
    start = (addr + page - 1) & ~(page - 1)
    if _madvise is not None and addr + size - start >= page:
        _madvise(start, (addr + size - start) & ~(page - 1), _MADV_HUGEPAGE)
