"""Pools of named fields: recurrent state stacked over layers, per-request aux rows.

``entries`` is the one walk over an engine's fields: the exclusion list and the
``None`` skip live there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from ..errors import ArgumentError, ManifestError
from ..manifest import Region
from .checks import check_ndim, check_pool, index, layer_ids, region


class Shard(msgspec.Struct, frozen=True):
    """How a state field is split over TP ranks: ``axis`` of its slot shape (the shape after
    ``[layers, slots]``), optional ``groups`` (global sizes of independently sharded blocks,
    e.g. a conv state's ``[q | k | v]``) and ``global_size`` (when ranks hold more than
    ``global / tp``, as with more ranks than heads)."""

    axis: int
    groups: tuple[int, ...] | None = None
    global_size: int | None = None

    def __post_init__(self) -> None:
        if type(self.axis) is not int or self.axis < 0:
            raise ArgumentError(f"Shard: axis must be an int >= 0, not {self.axis!r}")
        if self.groups is not None:
            if isinstance(self.groups, str | bytes) or not isinstance(self.groups, Sequence):
                raise ArgumentError(f"Shard: groups must be a tuple of ints, not {self.groups!r}")
            if not all(type(g) is int for g in self.groups):
                raise ArgumentError(f"Shard: groups must be a tuple of ints, not {self.groups!r}")
            msgspec.structs.force_setattr(self, "groups", tuple(self.groups))
        if self.global_size is not None and type(self.global_size) is not int:
            raise ArgumentError(
                f"Shard: global_size must be an int or None, not {self.global_size!r}"
            )


def state_pool(
    pool: str,
    *,
    fields: Mapping[str, Any],
    shards: Mapping[str, Shard | Sequence[Shard | None] | None],
    exclude: Sequence[str] = (),
    layers: Sequence[int] | None = None,
    device: str | None = None,
) -> list[Region]:
    """A recurrent-state pool (Mamba, GDN, short conv): each field stacked over layers,
    ``[layers, slots, ...]``, or a list of such tensors (one per stream: regions ``part`` 0,
    1, ...), or None (the model has none: skipped). Regions ``(pool, field, layer, part)``.

    ``exclude`` names fields the engine does not transfer (scratch buffers). ``shards``
    declares, for every field transferred, its ``Shard`` or None (replicated); for a list
    field one declaration for every entry, or a list with one per entry. ``layers`` are the
    model layer ids of axis 0 (default ``0..n-1``). A degenerate field (a zero-size axis)
    gives empty regions, which ``Manifest.build`` drops and lists in ``dropped``.
    """
    where = "pools.state_pool"
    check_pool(pool, where)
    if not isinstance(shards, Mapping):
        raise ArgumentError(f"{where}: shards must be a mapping of field to Shard or None")
    todo = list(entries(fields, exclude, where))
    if layers is not None:  # checked even when no field is left to give the count
        layer_ids(layers, len(layers) if isinstance(layers, list | tuple | range) else 0, where, "")
    unknown = sorted(str(f) for f in shards if f not in fields)
    if unknown:
        raise ArgumentError(f"{where}: shards names {unknown}, which are not fields")
    ids: list[int] | None = None
    out = []
    for field, part, count, tensor, what in todo:
        if field not in shards:
            raise ArgumentError(
                f"{what}: no sharding declared; give shards[{field!r}] = Shard(...) "
                "or None (replicated)"
            )
        shard = _entry_shard(shards[field], part, count, f"{where}: shards[{field!r}]")
        shape = check_ndim(tensor, None, "[layers, slots, ...]", what, pool)
        if ids is None:
            ids = layer_ids(layers, shape[0], where, f"field {field!r}")
        elif shape[0] != len(ids):
            raise ManifestError(
                f"{what}: {shape[0]} layers on axis 0, but the pool has {len(ids)}", subject=pool
            )
        if shard is not None and shard.axis >= len(shape) - 2:
            raise ArgumentError(
                f"{what}: Shard axis {shard.axis} is out of range for slot shape {tuple(shape[2:])}"
            )
        for i, layer in enumerate(ids):
            out.append(
                region(
                    what,
                    index(tensor, i, what, pool),
                    pool=pool,
                    name=field,
                    layer=layer,
                    part=part,
                    tp_axis=None if shard is None else shard.axis,
                    tp_groups=None if shard is None else shard.groups,
                    tp_global=None if shard is None else shard.global_size,
                    device=device,
                )
            )
    return out


def aux_rows(
    pool: str,
    *,
    fields: Mapping[str, Any],
    exclude: Sequence[str] = (),
    device: str | None = None,
) -> list[Region]:
    """Small per-request buffers indexed by request slot (first output token, logprobs,
    metadata), each ``[slots, ...]``, a list of such (parts) or None (skipped): regions
    ``(pool, field, 0, part)``, replicated (every rank's row is the whole row)."""
    where = "pools.aux_rows"
    check_pool(pool, where)
    return [
        region(what, tensor, pool=pool, name=field, layer=0, part=part, device=device)
        for field, part, _, tensor, what in entries(fields, exclude, where)
    ]


def entries(
    fields: Mapping[str, Any], exclude: Sequence[str], where: str
) -> Iterator[tuple[str, int, int, Any, str]]:
    """(field, part, entries in the field, tensor, label) of every tensor to transfer."""
    if not isinstance(fields, Mapping):
        raise ArgumentError(f"{where}: fields must be a mapping of name to tensor, not {fields!r}")
    if isinstance(exclude, str | bytes) or not isinstance(exclude, Sequence | set | frozenset):
        raise ArgumentError(f"{where}: exclude must be a list of field names, not {exclude!r}")
    for name in list(fields) + list(exclude):
        if type(name) is not str or not name:
            raise ArgumentError(f"{where}: field names are non-empty str, not {name!r}")
    stray = sorted(set(exclude) - set(fields))
    if stray:
        raise ArgumentError(f"{where}: exclude names {stray}, which are not fields")
    skip = set(exclude)
    for field, value in fields.items():
        if field in skip or value is None:
            continue
        if isinstance(value, list | tuple):
            if not value:
                raise ArgumentError(f"{where}: field {field!r} is an empty list")
            for part, tensor in enumerate(value):
                yield field, part, len(value), tensor, f"{where}: field {field!r} entry {part}"
        else:
            yield field, 0, 1, value, f"{where}: field {field!r}"


def _entry_shard(decl: Any, part: int, count: int, what: str) -> Shard | None:
    if isinstance(decl, list | tuple):
        if len(decl) != count:
            raise ArgumentError(f"{what}: {len(decl)} declarations for {count} entries")
        decl = decl[part]
    if decl is not None and not isinstance(decl, Shard):
        raise ArgumentError(f"{what}: a Shard or None, not {type(decl).__name__} {decl!r:.60}")
    return decl
