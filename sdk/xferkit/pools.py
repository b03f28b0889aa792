"""An engine's cache pools, as it allocates them, turned into Regions in one call per pool.

Engines hold their caches in a few recurring shapes: paged K and V per attention
layer, an MLA latent per layer, recurrent state stacked over layers
(``[layers, slots, ...]``, some fields lists of per-stream tensors), and small
per-request aux rows. Each builder here walks one such description and names
its regions ``(pool, name, layer, part)``, the key the planner pairs by, so two
engines describing the same model the same way pair region for region.

What the builders do not do, on purpose: guess sharding (the caller declares
it: a KV layout names the heads axis, a ``Shard`` names a state field's axis
and groups) and filter empty buffers. They return every region, empty ones
included; ``Manifest.build`` is the one empty filter and records what it
drops in ``Manifest.dropped``. Tensors are duck-typed (numpy arrays, torch
tensors): nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import msgspec

from .arrays import describe
from .errors import ArgumentError, ManifestError, XferError
from .manifest import PAGE_AXIS, Region

__all__ = ["KV_LAYOUTS", "Shard", "aux_rows", "kv_pages", "mla_pages", "state_pool"]

KV_LAYOUTS: Mapping[str, tuple[str, str, str]] = {
    "NHD": (PAGE_AXIS, "head", "dim"),
    "HND": ("head", PAGE_AXIS, "dim"),
}
"""A KV page's axes (after the slot axis) per layout: named, so NHD pairs with HND."""

Layout = Literal["NHD", "HND"]


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


def kv_pages(
    pool: str,
    *,
    k: Sequence[Any],
    v: Sequence[Any],
    layout: Layout,
    layers: Sequence[int] | None = None,
    shard_heads: bool = True,
    heads_global: int | None = None,
    device: str | None = None,
) -> list[Region]:
    """Paged K and V, one tensor per attention layer, ``[slots, *page]`` with the page laid
    out as ``layout`` says (``KV_LAYOUTS``): regions ``(pool, "k"|"v", layer, 0)``.

    ``layers`` are the layer ids of ``k[i]``/``v[i]`` (default ``0..n-1``; give the model's
    ids under pipeline parallelism or when only some layers attend). Heads are sharded
    over TP unless ``shard_heads=False``; ``heads_global`` is the model's KV head count when
    ranks outnumber heads (each head then lives on several ranks).
    """
    where = "pools.kv_pages"
    _check_pool(pool, where)
    if not isinstance(layout, str) or layout not in KV_LAYOUTS:
        raise ArgumentError(f"{where}: layout must be one of {sorted(KV_LAYOUTS)}, not {layout!r}")
    if type(shard_heads) is not bool:
        raise ArgumentError(f"{where}: shard_heads must be a bool, not {shard_heads!r}")
    if heads_global is not None and (not shard_heads or type(heads_global) is not int):
        raise ArgumentError(
            f"{where}: heads_global must be an int, and only with shard_heads, not {heads_global!r}"
        )
    axes = KV_LAYOUTS[layout]
    ks, vs = _tensor_list(k, where, "k"), _tensor_list(v, where, "v")
    if len(ks) != len(vs):
        raise ArgumentError(f"{where}: k has {len(ks)} layers but v has {len(vs)}")
    ids = _layer_ids(layers, len(ks), where, "k and v")
    tp_axis = axes.index("head") if shard_heads else None
    out = []
    for name, tensors in (("k", ks), ("v", vs)):
        for i, (layer, tensor) in enumerate(zip(ids, tensors, strict=True)):
            what = f"{where}: {name}[{i}]"
            _check_ndim(tensor, 1 + len(axes), f"[slots, {', '.join(axes)}]", what, pool)
            out.append(
                _region(
                    what,
                    tensor,
                    pool=pool,
                    name=name,
                    layer=layer,
                    tp_axis=tp_axis,
                    tp_global=heads_global,
                    axes=axes,
                    device=device,
                )
            )
    return out


def mla_pages(
    pool: str,
    *,
    latent: Sequence[Any],
    layers: Sequence[int] | None = None,
    name: str = "latent",
    axes: Sequence[str] | None = None,
    device: str | None = None,
) -> list[Region]:
    """An MLA latent cache, one tensor ``[slots, ...]`` per layer: regions
    ``(pool, name, layer, 0)``, replicated (every TP rank holds the whole latent).

    ``axes`` names the axes after the slot axis; name the token axis ``PAGE_AXIS`` to let
    the two sides' page sizes differ by a whole factor.
    """
    where = "pools.mla_pages"
    _check_pool(pool, where)
    if type(name) is not str or not name:
        raise ArgumentError(f"{where}: name must be a non-empty str, not {name!r}")
    tensors = _tensor_list(latent, where, "latent")
    ids = _layer_ids(layers, len(tensors), where, "latent")
    named = _axes(axes, where)
    out = []
    for i, (layer, tensor) in enumerate(zip(ids, tensors, strict=True)):
        what = f"{where}: latent[{i}]"
        if named is not None:
            _check_ndim(tensor, 1 + len(named), f"[slots, {', '.join(named)}]", what, pool)
        region = _region(what, tensor, pool=pool, name=name, layer=layer, axes=named, device=device)
        out.append(region)
    return out


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
    _check_pool(pool, where)
    if not isinstance(shards, Mapping):
        raise ArgumentError(f"{where}: shards must be a mapping of field to Shard or None")
    entries = list(_entries(fields, exclude, where))
    if layers is not None:  # checked even when no field is left to give the count
        _layer_ids(
            layers, len(layers) if isinstance(layers, list | tuple | range) else 0, where, ""
        )
    unknown = sorted(str(f) for f in shards if f not in fields)
    if unknown:
        raise ArgumentError(f"{where}: shards names {unknown}, which are not fields")
    ids: list[int] | None = None
    out = []
    for field, part, count, tensor, what in entries:
        if field not in shards:
            raise ArgumentError(
                f"{what}: no sharding declared; give shards[{field!r}] = Shard(...) "
                "or None (replicated)"
            )
        shard = _entry_shard(shards[field], part, count, f"{where}: shards[{field!r}]")
        shape = _check_ndim(tensor, None, "[layers, slots, ...]", what, pool)
        if ids is None:
            ids = _layer_ids(layers, shape[0], where, f"field {field!r}")
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
                _region(
                    what,
                    _index(tensor, i, what, pool),
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
    _check_pool(pool, where)
    return [
        _region(what, tensor, pool=pool, name=field, layer=0, part=part, device=device)
        for field, part, _, tensor, what in _entries(fields, exclude, where)
    ]


# -- the one walk over fields: the exclusion list and the None skip ---------


def _entries(
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


# -- small checks -------------------------------------------------------------


def _check_pool(pool: Any, where: str) -> None:
    if type(pool) is not str or not pool:
        raise ArgumentError(f"{where}: pool must be a non-empty str, not {pool!r}")


def _tensor_list(value: Any, where: str, what: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ArgumentError(
            f"{where}: {what} must be a list of per-layer tensors, not {type(value).__name__}"
        )
    return list(value)


def _layer_ids(layers: Any, count: int, where: str, what: str) -> list[int]:
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


def _axes(axes: Any, where: str) -> tuple[str, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, str | bytes) or not isinstance(axes, Sequence):
        raise ArgumentError(f"{where}: axes must be a list of names, not {axes!r}")
    if not all(type(a) is str for a in axes):
        raise ArgumentError(f"{where}: axes must be a list of names, not {axes!r}")
    return tuple(axes)


def _check_ndim(tensor: Any, ndim: int | None, want: str, what: str, pool: str) -> tuple[int, ...]:
    """The tensor's shape, once it is a tensor of ``ndim`` axes (at least 2 when None)."""
    try:
        shape = describe(tensor, (pool,), f"{pool}/*")[1]
    except XferError as exc:
        raise ManifestError(f"{what}: {exc}", subject=pool) from None
    if (len(shape) != ndim) if ndim is not None else len(shape) < 2:
        raise ManifestError(f"{what}: shape {shape} is not {want}", subject=pool)
    return shape


def _index(tensor: Any, i: int, what: str, pool: str) -> Any:
    try:
        return tensor[i]
    except Exception as exc:  # an interface-only object that cannot be indexed
        raise ManifestError(
            f"{what}: cannot take layer {i} of {type(tensor).__name__}: {exc}", subject=pool
        ) from None


def _region(what: str, tensor: Any, **fields: Any) -> Region:
    """``Region.from_array``, its errors prefixed with the field that caused them."""
    try:
        return Region.from_array(tensor, **fields)
    except XferError as exc:
        raise type(exc)(f"{what}: {exc}", subject=exc.subject) from None
