"""Which memory takes part in a transfer: one table of regions, every other view derived.

``Manifest.build`` is the only place where empty regions are filtered out, so a
zero-length buffer can never reach a registration list or a descriptor, and
the per-region views (addresses, lengths, slot sizes, sharded dims) are all
computed from the same table: they cannot drift apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np

from .errors import ManifestError
from .sharding import AxisLayout, axis_layout

RegionKey = tuple[str, str, int, int]
"""(pool, name, layer, part): how regions are named and paired across engines."""

_DEVICE = re.compile(r"^(?:cpu|cuda:(\d+))$")


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:3"`` -> ``("cuda", 3)``, ``"cpu"`` -> ``("cpu", 0)``; ValueError otherwise."""
    m = _DEVICE.match(device) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"device {device!r} is neither 'cpu' nor 'cuda:N'")
    return ("cpu", 0) if m.group(1) is None else ("cuda", int(m.group(1)))


def key_label(key: RegionKey) -> str:
    """A short human name for a region key, e.g. ``state/conv[3]#1``."""
    pool, name, layer, part = key
    return f"{pool}/{name}[{layer}]" + (f"#{part}" if part else "")


class Region(msgspec.Struct, frozen=True, kw_only=True):
    """One contiguous memory region of shape ``[slots, *slot_shape]``.

    The first axis indexes slots of ``pool`` (the unit a request allocates).
    ``tp_axis`` is the axis of ``slot_shape`` sharded across tensor-parallel
    ranks (None: every rank holds all of it). ``tp_groups`` gives the global
    sizes of independently sharded blocks along that axis (e.g. a conv state
    laid out ``[q | k | v]``); ``tp_global`` the global size of the axis when
    it is not ``local * tp_size`` (e.g. more TP ranks than KV heads).
    """

    pool: str
    name: str
    layer: int
    part: int = 0
    addr: int
    nbytes: int
    slot_shape: tuple[int, ...]
    itemsize: int
    device: str = "cpu"
    tp_axis: int | None = None
    tp_groups: tuple[int, ...] | None = None
    tp_global: int | None = None

    @property
    def key(self) -> RegionKey:
        return (self.pool, self.name, self.layer, self.part)

    @property
    def label(self) -> str:
        return key_label(self.key)

    @property
    def slot_nbytes(self) -> int:
        return math.prod(self.slot_shape) * self.itemsize

    @property
    def slots(self) -> int:
        size = self.slot_nbytes
        return self.nbytes // size if size else 0

    def axis_layout(self, tp_size: int) -> AxisLayout | None:
        """How the sharded axis splits over ``tp_size`` ranks; None when replicated."""
        if self.tp_axis is None:
            return None
        return axis_layout(self.slot_shape[self.tp_axis], tp_size, self.tp_groups, self.tp_global)

    @classmethod
    def from_array(
        cls,
        array: Any,
        *,
        pool: str,
        name: str,
        layer: int,
        part: int = 0,
        tp_axis: int | None = None,
        tp_groups: tuple[int, ...] | None = None,
        tp_global: int | None = None,
        device: str | None = None,
    ) -> Region:
        """Describe a numpy array or a torch tensor (duck-typed: no torch import).

        The first axis is the slot axis. ``device`` overrides what the array
        reports (needed for ``__cuda_array_interface__`` objects, which do not
        say which GPU they live on).
        """
        label = key_label((pool, name, layer, part))
        addr, shape, itemsize, contiguous, found_device = _describe(array, label)
        if not contiguous:
            raise ManifestError(
                f"region {label}: the array is not contiguous; register a contiguous "
                "tensor (or its base) so that slots are evenly spaced",
                subject=(pool, name, layer, part),
            )
        if len(shape) < 1:
            raise ManifestError(
                f"region {label}: a 0-d array has no slot axis",
                subject=(pool, name, layer, part),
            )
        return cls(
            pool=pool,
            name=name,
            layer=layer,
            part=part,
            addr=addr,
            nbytes=math.prod(shape) * itemsize,
            slot_shape=tuple(shape[1:]),
            itemsize=itemsize,
            device=device or found_device,
            tp_axis=tp_axis,
            tp_groups=tuple(tp_groups) if tp_groups is not None else None,
            tp_global=tp_global,
        )


def _describe(array: Any, label: str) -> tuple[int, tuple[int, ...], int, bool, str]:
    """(address, shape, itemsize, C-contiguous, device) of a tensor-like object."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size"):  # torch.Tensor
        return (
            int(array.data_ptr()),
            tuple(int(n) for n in array.shape),
            int(array.element_size()),
            bool(array.is_contiguous()),
            str(array.device),
        )
    for attr, device in (("__cuda_array_interface__", "cuda:0"), ("__array_interface__", "cpu")):
        face = getattr(array, attr, None)
        if face is None:
            continue
        shape = tuple(int(n) for n in face["shape"])
        itemsize = np.dtype(face["typestr"]).itemsize
        strides = face.get("strides")
        contiguous = strides is None or all(
            n == 1 or s == c
            for n, s, c in zip(shape, strides, _c_strides(shape, itemsize), strict=True)
        )
        return int(face["data"][0] or 0), shape, itemsize, contiguous, device
    raise ManifestError(
        f"region {label}: {type(array).__name__} is neither a torch tensor nor exposes "
        "__array_interface__ / __cuda_array_interface__",
        subject=label,
    )


def _c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


class AddressTable:
    """Disjoint address ranges, sorted once, looked up vectorized in O(n log ranges).

    Ends are kept inclusive (the last byte), so a range ending at 2**64 never wraps.
    """

    __slots__ = ("last", "order", "starts")

    def __init__(self, addrs: np.ndarray, nbytes: np.ndarray) -> None:
        addrs = np.asarray(addrs, dtype=np.uint64)
        self.order = np.argsort(addrs, kind="stable")
        self.starts = addrs[self.order]
        self.last = self.starts + (np.asarray(nbytes, dtype=np.uint64)[self.order] - np.uint64(1))

    def __len__(self) -> int:
        return int(self.starts.size)

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray | None = None) -> np.ndarray:
        """Index (into the ranges as given) of the range holding each ``[addr, addr+nbytes)``.

        -1 where none holds it whole, including a range that wraps past 2**64.
        """
        addrs = np.asarray(addrs, dtype=np.uint64)
        size = np.ones_like(addrs) if nbytes is None else np.asarray(nbytes, dtype=np.uint64)
        if not self.starts.size:
            return np.full(addrs.shape, -1, dtype=np.int64)
        where = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        clipped = np.maximum(where, 0)
        end = addrs + (np.maximum(size, np.uint64(1)) - np.uint64(1))
        inside = (where >= 0) & (end >= addrs) & (end <= self.last[clipped])
        return np.where(inside, self.order[clipped], -1)

    def nearest(self, addr: int) -> int:
        """Index of the range starting at or below ``addr`` (else the lowest); -1 when empty."""
        if not self.starts.size:
            return -1
        i = int(np.searchsorted(self.starts, np.uint64(addr), side="right")) - 1
        return int(self.order[max(i, 0)])

    def first_overlap(self) -> tuple[int, int] | None:
        """Indices of two ranges that overlap, or None."""
        clash = np.flatnonzero(self.last[:-1] >= self.starts[1:])
        if not clash.size:
            return None
        return int(self.order[clash[0]]), int(self.order[clash[0] + 1])


class Dropped(msgspec.Struct, frozen=True):
    """A region left out by the empty-buffer filter, and why."""

    key: RegionKey
    reason: str


def _empty_reason(region: Region) -> str | None:
    if region.nbytes != 0:
        return None
    zero = [i for i, n in enumerate(region.slot_shape) if n == 0]
    if zero:
        return f"slot_shape {region.slot_shape} has a zero-size axis {zero[0]}: 0 bytes"
    return "0 bytes (no slots)"


class Manifest(msgspec.Struct, frozen=True, dict=True):
    """The regions one rank offers, with every per-region view derived from them.

    Build it with ``Manifest.build``; constructing or decoding one directly
    validates the same invariants but does not filter empty regions (an empty
    region there is an error: it means the filter was bypassed).
    """

    regions: tuple[Region, ...]
    tp_rank: int
    tp_size: int
    dropped: tuple[Dropped, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def build(cls, regions: Iterable[Region], *, tp_rank: int = 0, tp_size: int = 1) -> Manifest:
        """Drop empty regions (recording why), then validate everything else."""
        kept: list[Region] = []
        dropped: list[Dropped] = []
        for region in regions:
            reason = _empty_reason(region)
            if reason is None:
                kept.append(region)
            else:
                dropped.append(Dropped(region.key, reason))
        return cls(tuple(kept), tp_rank, tp_size, tuple(dropped))

    # -- derived views: position i of each describes regions[i] -------------

    def __len__(self) -> int:
        return len(self.regions)

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions)

    @cached_property
    def keys(self) -> tuple[RegionKey, ...]:
        return tuple(r.key for r in self.regions)

    @cached_property
    def addrs(self) -> np.ndarray:
        return _frozen([r.addr for r in self.regions])

    @cached_property
    def nbytes(self) -> np.ndarray:
        return _frozen([r.nbytes for r in self.regions])

    @cached_property
    def item_nbytes(self) -> np.ndarray:
        """Bytes per slot of each region (what RDMA drivers call the item length)."""
        return _frozen([r.slot_nbytes for r in self.regions])

    @cached_property
    def slots(self) -> np.ndarray:
        return _frozen([r.slots for r in self.regions])

    @cached_property
    def tp_dims(self) -> np.ndarray:
        """Local size of each region's sharded axis; 0 for a replicated region."""
        return _frozen([0 if r.tp_axis is None else r.slot_shape[r.tp_axis] for r in self.regions])

    @cached_property
    def pools(self) -> Mapping[str, int]:
        """Slot count of each pool (read-only)."""
        return MappingProxyType({r.pool: r.slots for r in self.regions})

    @cached_property
    def dropped_keys(self) -> frozenset[RegionKey]:
        return frozenset(d.key for d in self.dropped)

    @cached_property
    def _index(self) -> dict[RegionKey, int]:
        return {k: i for i, k in enumerate(self.keys)}

    def index(self, key: RegionKey) -> int:
        """Position of ``key`` in every view."""
        try:
            return self._index[key]
        except KeyError:
            msg = f"no region {key_label(key)} in this manifest"
            raise ManifestError(msg, subject=key) from None

    @cached_property
    def table(self) -> AddressTable:
        """The regions as an address table: ``table.locate`` maps addresses to region indices."""
        return AddressTable(self.addrs, self.nbytes)

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray | None = None) -> np.ndarray:
        """Index in ``regions`` of the region holding each ``[addr, addr + nbytes)``; -1 if none.

        The one address lookup: the core's bounds checks, drivers that need a
        descriptor's region (its device, its slot) and the test checkers use it.
        """
        return self.table.locate(addrs, nbytes)

    def nearest(self, addr: int) -> Region | None:
        """The region starting at or below ``addr`` (else the lowest): for error messages."""
        i = self.table.nearest(addr)
        return None if i < 0 else self.regions[i]

    def region(self, key: RegionKey) -> Region:
        return self.regions[self.index(key)]

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def encode(self) -> bytes:
        """msgpack bytes a peer decodes with ``Manifest.decode``."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
            raise ManifestError(f"malformed manifest: {exc}") from exc


def _frozen(values: list[int]) -> np.ndarray:
    out = np.array(values, dtype=np.uint64)
    out.setflags(write=False)
    return out


def _validate(m: Manifest) -> None:
    if m.tp_size < 1 or not 0 <= m.tp_rank < m.tp_size:
        raise ManifestError(f"tp_rank {m.tp_rank} is not a rank of tp_size {m.tp_size}")
    seen: dict[RegionKey, Region] = {}
    pool_slots: dict[str, Region] = {}
    for r in m.regions:
        _validate_region(r, m.tp_size)
        if r.key in seen:
            raise ManifestError(f"region {r.label} appears twice", subject=r.key)
        seen[r.key] = r
        first = pool_slots.setdefault(r.pool, r)
        if first.slots != r.slots:
            raise ManifestError(
                f"region {r.label} has {r.slots} slots but {first.label} has {first.slots}: "
                f"every region of pool {r.pool!r} must index the same slots",
                subject=r.key,
            )
    for d in m.dropped:
        if d.key in seen:
            raise ManifestError(
                f"region {key_label(d.key)} is both kept and dropped", subject=d.key
            )
    _check_overlaps(m)


def _validate_region(r: Region, tp_size: int) -> None:
    def fail(why: str) -> ManifestError:
        return ManifestError(f"region {r.label}: {why}", subject=r.key)

    if r.itemsize <= 0:
        raise fail(f"itemsize {r.itemsize} must be positive")
    if any(n < 0 for n in r.slot_shape):
        raise fail(f"slot_shape {r.slot_shape} has a negative size")
    if r.nbytes <= 0:
        raise fail(
            f"nbytes is {r.nbytes}; empty regions must go through Manifest.build, "
            "which drops them before they can reach a driver"
        )
    if r.slot_nbytes == 0 or r.nbytes % r.slot_nbytes:
        raise fail(f"nbytes {r.nbytes} is not a multiple of the slot size {r.slot_nbytes}")
    if r.addr <= 0 or r.addr + r.nbytes > 2**64:
        raise fail(f"address {r.addr:#x} is null or out of range")
    if not _DEVICE.match(r.device):
        raise fail(f"device {r.device!r} is neither 'cpu' nor 'cuda:N'")
    if r.tp_axis is None:
        if r.tp_groups is not None or r.tp_global is not None:
            raise fail("tp_groups / tp_global given for a replicated region (tp_axis is None)")
        return
    if not 0 <= r.tp_axis < len(r.slot_shape):
        raise fail(f"tp_axis {r.tp_axis} is out of range for slot_shape {r.slot_shape}")
    try:
        r.axis_layout(tp_size)
    except ValueError as exc:
        raise fail(str(exc)) from None


def _check_overlaps(m: Manifest) -> None:
    """Regions must be disjoint across devices too: a descriptor names an address, not a device."""
    clash = m.table.first_overlap()
    if clash is not None:
        a, b = m.regions[clash[0]], m.regions[clash[1]]
        raise ManifestError(
            f"regions {a.label} [{a.addr:#x}, +{a.nbytes}) on {a.device} and {b.label} "
            f"[{b.addr:#x}, +{b.nbytes}) on {b.device} overlap",
            subject=b.key,
        )
