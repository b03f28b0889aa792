"""Per-layer paged caches: K and V of attention layers, MLA latents."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..errors import ArgumentError
from ..manifest import PAGE_AXIS, Region
from .checks import axes_of, check_ndim, check_pool, layer_ids, region, tensor_list

KV_LAYOUTS: Mapping[str, tuple[str, str, str]] = {
    "NHD": (PAGE_AXIS, "head", "dim"),
    "HND": ("head", PAGE_AXIS, "dim"),
}
"""A KV page's axes (after the slot axis) per layout: named, so NHD pairs with HND."""

Layout = Literal["NHD", "HND"]


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
    check_pool(pool, where)
    if not isinstance(layout, str) or layout not in KV_LAYOUTS:
        raise ArgumentError(f"{where}: layout must be one of {sorted(KV_LAYOUTS)}, not {layout!r}")
    if type(shard_heads) is not bool:
        raise ArgumentError(f"{where}: shard_heads must be a bool, not {shard_heads!r}")
    if heads_global is not None and (not shard_heads or type(heads_global) is not int):
        raise ArgumentError(
            f"{where}: heads_global must be an int, and only with shard_heads, not {heads_global!r}"
        )
    axes = KV_LAYOUTS[layout]
    ks, vs = tensor_list(k, where, "k"), tensor_list(v, where, "v")
    if len(ks) != len(vs):
        raise ArgumentError(f"{where}: k has {len(ks)} layers but v has {len(vs)}")
    ids = layer_ids(layers, len(ks), where, "k and v")
    tp_axis = axes.index("head") if shard_heads else None
    out = []
    for name, tensors in (("k", ks), ("v", vs)):
        for i, (layer, tensor) in enumerate(zip(ids, tensors, strict=True)):
            what = f"{where}: {name}[{i}]"
            check_ndim(tensor, 1 + len(axes), f"[slots, {', '.join(axes)}]", what, pool)
            out.append(
                region(
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
    check_pool(pool, where)
    if type(name) is not str or not name:
        raise ArgumentError(f"{where}: name must be a non-empty str, not {name!r}")
    tensors = tensor_list(latent, where, "latent")
    ids = layer_ids(layers, len(tensors), where, "latent")
    named = axes_of(axes, where)
    out = []
    for i, (layer, tensor) in enumerate(zip(ids, tensors, strict=True)):
        what = f"{where}: latent[{i}]"
        if named is not None:
            check_ndim(tensor, 1 + len(named), f"[slots, {', '.join(named)}]", what, pool)
        out.append(
            region(what, tensor, pool=pool, name=name, layer=layer, axes=named, device=device)
        )
    return out
