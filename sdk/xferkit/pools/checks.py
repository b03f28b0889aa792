"""The builders' argument checks, and ``region``: ``Region.from_array`` with the field that
caused an error named in front of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..arrays import describe
from ..errors import ArgumentError, ManifestError, XferError
from ..manifest import Region


def check_pool(pool: Any, where: str) -> None:
    if type(pool) is not str or not pool:
        raise ArgumentError(f"{where}: pool must be a non-empty str, not {pool!r}")


def tensor_list(value: Any, where: str, what: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ArgumentError(
            f"{where}: {what} must be a list of per-layer tensors, not {type(value).__name__}"
        )
    return list(value)


def layer_ids(layers: Any, count: int, where: str, what: str) -> list[int]:
    if layers is None:
        return list(range(count))
    if not isinstance(layers, list | tuple | range) or not all(
        type(i) is int and i >= 0 for i in layers
    ):
        raise ArgumentError(f"{where}: layers must be a list of ints >= 0, not {layers!r:.80}")
    if len(layers) != count:
        raise ArgumentError(f"{where}: {len(layers)} layer ids for {count} layers of {what}")
    if len(set(layers)) != len(layers):
        raise ArgumentError(f"{where}: layer ids {list(layers)} repeat")
    return list(layers)


def axes_of(axes: Any, where: str) -> tuple[str, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, str | bytes) or not isinstance(axes, Sequence):
        raise ArgumentError(f"{where}: axes must be a list of names, not {axes!r}")
    if not all(type(a) is str for a in axes):
        raise ArgumentError(f"{where}: axes must be a list of names, not {axes!r}")
    return tuple(axes)


def check_ndim(tensor: Any, ndim: int | None, want: str, what: str, pool: str) -> tuple[int, ...]:
    """The tensor's shape, once it is a tensor of ``ndim`` axes (at least 2 when None)."""
    try:
        shape = describe(tensor, (pool,), f"{pool}/*")[1]
    except XferError as exc:
        raise ManifestError(f"{what}: {exc}", subject=pool) from None
    if (len(shape) != ndim) if ndim is not None else len(shape) < 2:
        raise ManifestError(f"{what}: shape {shape} is not {want}", subject=pool)
    return shape


def index(tensor: Any, i: int, what: str, pool: str) -> Any:
    try:
        return tensor[i]
    except Exception as exc:  # an interface-only object that cannot be indexed
        raise ManifestError(
            f"{what}: cannot take layer {i} of {type(tensor).__name__}: {exc}", subject=pool
        ) from None


def region(what: str, tensor: Any, **fields: Any) -> Region:
    """``Region.from_array``, its errors prefixed with the field that caused them."""
    try:
        return Region.from_array(tensor, **fields)
    except XferError as exc:
        raise type(exc)(f"{what}: {exc}", subject=exc.subject) from None
