"""Which memory takes part in a transfer: one table of regions, every other view derived.

``Manifest.build`` is the only place where empty regions are filtered out, so a
zero-length buffer can never reach a registration list or a descriptor, and
the per-region views (addresses, lengths, slot sizes, sharded dims) are all
computed from the same table: they cannot drift apart.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np

from .addresses import AddressTable
from .arguments import expect, items
from .arrays import describe
from .errors import ArgumentError, ManifestError
from .sharding import AxisLayout, axis_layout

RegionKey = tuple[str, str, int, int]
"""(pool, name, layer, part): how regions are named and paired across engines."""

PAGE_AXIS = "token"
"""The axis name whose size may differ between paired regions by a whole factor: a slot of one
side then holds several pages of the other (``Region.axes``)."""

STAGING_POOL = "xferkit.staging"
"""The pool of staging memory: registered and advertised like any region (so writes into it
are bounds-checked), never paired by the planner."""

_DEVICE = re.compile(r"^(?:cpu|cuda:(\d+))$")


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:3"`` -> ``("cuda", 3)``, ``"cpu"`` -> ``("cpu", 0)``; ValueError otherwise."""
    m = _DEVICE.match(device) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"device {device!r} is neither 'cpu' nor 'cuda:N'")
    return ("cpu", 0) if m.group(1) is None else ("cuda", int(m.group(1)))


def key_label(key: RegionKey) -> str:
    """A short human name for a region key, e.g. ``state/conv[3]#1``."""
    if not isinstance(key, tuple) or len(key) != 4:
        raise ArgumentError(f"a region key is (pool, name, layer, part), not {key!r:.80}")
    pool, name, layer, part = key
    return f"{pool}/{name}[{layer}]" + ("" if type(part) is int and part == 0 else f"#{part}")


class Region(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """One contiguous memory region of shape ``[slots, *slot_shape]``.

    The first axis indexes slots of ``pool`` (the unit a request allocates).
    ``tp_axis`` is the axis of ``slot_shape`` sharded across tensor-parallel
    ranks (None: every rank holds all of it). ``axes`` names the axes of
    ``slot_shape``: when both sides of a pair name them, axes pair by name, so
    one side may be NHD and the other HND, and the ``PAGE_AXIS`` may hold a
    whole multiple of the other side's tokens. ``tp_groups`` gives the global
    sizes of independently sharded blocks along that axis (e.g. a conv state
    laid out ``[q | k | v]``); ``tp_global`` the global size of the axis when
    it is not ``local * tp_size`` (e.g. more TP ranks than KV heads).

    Ownership: a region made by ``from_array`` holds the array (``owner``), so
    its memory stays valid for as long as the region, and any manifest or
    backend holding it, lives. A region built from a raw address is the
    caller's promise that the memory outlives every use of it.
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
    axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_types(self)

    @property
    def owner(self) -> Any:
        """The array this region was made from (kept alive by it), or None."""
        return self.__dict__.get("_owner")

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
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ArgumentError(f"axis_layout takes a tp_size >= 1, not {tp_size!r:.40}")
        if self.tp_axis is None:
            return None
        local = self.slot_shape[self.tp_axis]
        try:
            return axis_layout(local, tp_size, self.tp_groups, self.tp_global)
        except ValueError as exc:
            raise ManifestError(f"region {self.label}: {exc}", subject=self.key) from None

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
        axes: tuple[str, ...] | None = None,
        device: str | None = None,
    ) -> Region:
        """Describe a numpy array or a torch tensor (duck-typed: no torch import).

        The first axis is the slot axis. ``device`` overrides what the array
        reports (needed for a ``__cuda_array_interface__`` object on another GPU
        than 0 without ``__dlpack_device__``: xferkit.arrays gives the rule).
        """
        subject = (pool, name, layer, part)
        label = key_label(subject)
        if device is not None and type(device) is not str:
            raise ArgumentError(f"region {label}: device must be a str or None, not {device!r:.60}")
        addr, shape, itemsize, contiguous, device = describe(array, subject, label, device)
        try:
            parse_device(device)
        except ValueError:
            raise ManifestError(
                f"region {label}: device {device!r} is neither 'cpu' nor 'cuda:N'; drivers "
                "register host or CUDA memory only",
                subject=subject,
            ) from None
        if not contiguous:
            raise ManifestError(
                f"region {label}: the array of shape {shape} is not C-contiguous, so its slots "
                "are not evenly spaced bytes. .contiguous() would copy it and a transfer would "
                "land in the copy: register the contiguous tensor it is a view of (the whole "
                "buffer, or a slice of its first axis) instead",
                subject=subject,
            )
        if len(shape) < 1:
            raise ManifestError(f"region {label}: a 0-d array has no slot axis", subject=subject)
        region = cls(
            pool=pool,
            name=name,
            layer=layer,
            part=part,
            addr=addr,
            nbytes=math.prod(shape) * itemsize,
            slot_shape=tuple(shape[1:]),
            itemsize=itemsize,
            device=device,
            tp_axis=tp_axis,
            tp_groups=_int_tuple(tp_groups, subject, "tp_groups")
            if tp_groups is not None
            else None,
            tp_global=tp_global,
            axes=_str_tuple(axes, subject) if axes is not None else None,
        )
        region.__dict__["_owner"] = array  # not encoded: it only keeps the memory alive
        storage = getattr(array, "untyped_storage", None)  # a torch tensor's memory itself:
        if callable(storage):  # kept too, so set_() or .data= on the tensor cannot free it
            with contextlib.suppress(Exception):  # (the tensor itself is held all the same)
                region.__dict__["_storage"] = storage()
        return region


def _int_tuple(value: Any, key: RegionKey, field: str) -> tuple[int, ...]:
    # Ordered only: a set's order changes with the hash seed, and these name positions.
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence | np.ndarray)
        or np.ndim(value) != 1
    ):
        raise ManifestError(
            f"region {key_label(key)}: {field} must be a sequence of ints, not {value!r}",
            subject=key,
        )
    return tuple(value)


def _str_tuple(value: Any, key: RegionKey) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ManifestError(
            f"region {key_label(key)}: axes must be a sequence of names, not {value!r}",
            subject=key,
        )
    return tuple(value)


_STR_FIELDS = ("pool", "name", "device")
_INT_FIELDS = ("layer", "part", "addr", "nbytes", "itemsize")
_OPTIONAL_INT_FIELDS = ("tp_axis", "tp_global")
_NAME_INTS = ("layer", "part")
"""Int fields of the region's key, which only the range check of msgpack would bound."""


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (numpy's too), else None; bools are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _check_types(r: Region) -> None:
    """Field types, checked when a Region is built (decoding checks them too): a ``layer="0"``
    would otherwise pair with nothing and silently move nothing."""
    label = f"{r.pool}/{r.name}[{r.layer}]"

    def bad(field: str, want: str) -> ManifestError:
        value = getattr(r, field)
        return ManifestError(
            f"region {label}: {field} must be {want}, not {type(value).__name__} {value!r}",
            subject=r.key,
        )

    for field in _STR_FIELDS:
        if type(getattr(r, field)) is not str:
            raise bad(field, "a str")
    for field in _INT_FIELDS:
        value = _as_int(getattr(r, field))
        if value is None:
            raise bad(field, "an int")
        if field in _NAME_INTS and not -(2**63) <= value < 2**63:  # else no peer can decode it
            raise bad(field, "a 64-bit int")
        msgspec.structs.force_setattr(r, field, value)
    for field in _OPTIONAL_INT_FIELDS:
        raw = getattr(r, field)
        if raw is not None:
            value = _as_int(raw)
            if value is None:
                raise bad(field, "an int or None")
            msgspec.structs.force_setattr(r, field, value)
    for field in ("slot_shape", "tp_groups"):
        raw = getattr(r, field)
        if raw is None and field == "tp_groups":
            continue
        if not isinstance(raw, tuple | list):
            raise bad(field, "a tuple of ints")
        values = tuple(_as_int(v) for v in raw)
        if any(v is None for v in values):
            raise bad(field, "a tuple of ints")
        msgspec.structs.force_setattr(r, field, values)
    if r.axes is not None:
        if not isinstance(r.axes, tuple | list) or not all(type(a) is str for a in r.axes):
            raise bad("axes", "a tuple of str")
        msgspec.structs.force_setattr(r, "axes", tuple(r.axes))


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


def _column(value: Callable[[Region], int], doc: str) -> cached_property[np.ndarray]:
    """A read-only uint64 view with one entry per region, computed once from the table."""

    def view(self: Manifest) -> np.ndarray:
        return _frozen([value(r) for r in self.regions])

    view.__doc__ = doc
    return cached_property(view)


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
        given = None if isinstance(regions, str | bytes | Region) else items(regions)
        if given is None:
            raise ArgumentError(f"Manifest.build takes an iterable of Regions, not {regions!r}")
        kept: list[Region] = []
        dropped: list[Dropped] = []
        for region in given:
            expect(region, Region, "Manifest.build")
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

    addrs = _column(lambda r: r.addr, "Start address of each region.")
    nbytes = _column(lambda r: r.nbytes, "Length of each region, in bytes.")
    slot_nbytes = _column(
        lambda r: r.slot_nbytes, "Bytes per slot of each region (RDMA drivers' item length)."
    )
    slots = _column(lambda r: r.slots, "Slot count of each region.")
    tp_dims = _column(
        lambda r: 0 if r.tp_axis is None else r.slot_shape[r.tp_axis],
        "Local size of each region's sharded axis; 0 for a replicated region.",
    )

    @cached_property
    def pools(self) -> Mapping[str, int]:
        """Slot count of each pool (read-only)."""
        return MappingProxyType({r.pool: r.slots for r in self.regions})

    @cached_property
    def dropped_keys(self) -> frozenset[RegionKey]:
        return frozenset(d.key for d in self.dropped)

    @cached_property
    def layers(self) -> frozenset[int]:
        """Every layer id this rank holds a region of, kept or dropped (a layer-wise write
        may name any of them)."""
        return frozenset(r.layer for r in self.regions) | {k[2] for k in self.dropped_keys}

    @cached_property
    def _index(self) -> dict[RegionKey, int]:
        return {k: i for i, k in enumerate(self.keys)}

    def index(self, key: RegionKey) -> int:
        """Position of ``key`` in every view."""
        try:
            return self._index[key]
        except TypeError:  # unhashable
            raise ArgumentError(
                f"a region key is (pool, name, layer, part), not {key!r:.80}"
            ) from None
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
        with _addresses("locate"):
            if np.ndim(addrs) != 1:
                raise ArgumentError(f"locate takes a 1-D array of addresses, not {addrs!r:.80}")
            return self.table.locate(addrs, nbytes)

    def first_outside(self, addrs: np.ndarray, nbytes: np.ndarray | None = None) -> int:
        """Index of the first range no region holds whole, or -1: the bounds check."""
        with _addresses("first_outside"):
            return self.table.first_outside(addrs, nbytes)

    def nearest(self, addr: int) -> Region | None:
        """The region starting at or below ``addr`` (else the lowest): for error messages."""
        if (
            isinstance(addr, bool)
            or not isinstance(addr, int | np.integer)
            or not 0 <= addr < 2**64
        ):
            raise ArgumentError(
                f"nearest takes an address (an int in [0, 2**64)), not {addr!r:.80}"
            )
        i = self.table.nearest(addr)
        return None if i < 0 else self.regions[i]

    def region(self, key: RegionKey) -> Region:
        return self.regions[self.index(key)]

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._index
        except TypeError:  # unhashable: no region's key
            return False

    def encode(self) -> bytes:
        """msgpack bytes a peer decodes with ``Manifest.decode``."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        expect(data, (bytes, bytearray, memoryview), "Manifest.decode")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
            raise ManifestError(f"malformed manifest: {exc}") from exc


@contextlib.contextmanager
def _addresses(call: str) -> Iterator[None]:
    """Addresses numpy cannot hold as uint64 (negative, past 2**64, not numbers) are the
    caller's ``ArgumentError``, not numpy's own."""
    try:
        yield
    except (TypeError, ValueError, OverflowError) as exc:
        raise ArgumentError(f"{call}: addresses must be uint64 values: {exc}") from None


def _frozen(values: list[int]) -> np.ndarray:
    out = np.array(values, dtype=np.uint64)
    out.setflags(write=False)
    return out


MAX_TP_SIZE = 4096
"""Largest TP size a manifest may claim: planning costs grow with it, and a peer sends it."""

MAX_AXES = 64
"""Most axes a slot may have (numpy's own limit): planning walks them, and a peer sends them."""


def _validate(m: Manifest) -> None:
    for field in ("tp_rank", "tp_size"):
        value = _as_int(getattr(m, field))
        if value is None:
            raise ManifestError(f"{field} must be an int, not {getattr(m, field)!r}")
        msgspec.structs.force_setattr(m, field, value)
    if not isinstance(m.regions, tuple) or not all(isinstance(r, Region) for r in m.regions):
        raise ManifestError("a Manifest's regions are a tuple of Regions; use Manifest.build")
    if not 1 <= m.tp_size <= MAX_TP_SIZE or not 0 <= m.tp_rank < m.tp_size:
        raise ManifestError(
            f"tp_rank {m.tp_rank} is not a rank of tp_size {m.tp_size} "
            f"(1 <= tp_size <= {MAX_TP_SIZE})"
        )
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
    if not isinstance(m.dropped, tuple) or not all(
        isinstance(d, Dropped) and _is_key(d.key) for d in m.dropped
    ):
        raise ManifestError("a Manifest's dropped are a tuple of Dropped; use Manifest.build")
    for d in m.dropped:
        if d.key in seen:
            raise ManifestError(
                f"region {key_label(d.key)} is both kept and dropped", subject=d.key
            )
    _check_overlaps(m)


def _is_key(key: object) -> bool:
    return (
        isinstance(key, tuple)
        and len(key) == 4
        and all(isinstance(k, str | int) and not isinstance(k, bool) for k in key)
    )


def _validate_region(r: Region, tp_size: int) -> None:
    def fail(why: str) -> ManifestError:
        return ManifestError(f"region {r.label}: {why}", subject=r.key)

    if r.itemsize <= 0:
        raise fail(f"itemsize {r.itemsize} must be positive")
    if len(r.slot_shape) > MAX_AXES:
        raise fail(f"slot_shape has {len(r.slot_shape)} axes, more than {MAX_AXES}")
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
    if r.axes is not None and (
        len(r.axes) != len(r.slot_shape) or len(set(r.axes)) != len(r.axes) or "" in r.axes
    ):
        raise fail(f"axes {r.axes} must name each axis of slot_shape {r.slot_shape} once")
    if r.tp_axis is None:
        if r.tp_groups is not None or r.tp_global is not None:
            raise fail("tp_groups / tp_global given for a replicated region (tp_axis is None)")
        return
    if not 0 <= r.tp_axis < len(r.slot_shape):
        raise fail(f"tp_axis {r.tp_axis} is out of range for slot_shape {r.slot_shape}")
    r.axis_layout(tp_size)  # a ManifestError naming the region where the axis cannot split


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
