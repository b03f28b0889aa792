"""The bench's model presets: what real deployments register per rank, at full shape.

Each preset builds ``RegionSpec``s (global shapes, before TP sharding) for a
model page of ``page`` tokens; ``shaped`` then applies the two sides' page
sizes and layouts. KV regions name their axes, so prefill and decode may hold
NHD or HND pages of different sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from ..manifest import PAGE_AXIS
from ..testing.models import gdn_layer, kv_layer
from ..testing.reference import RegionSpec

KV_AXES = (PAGE_AXIS, "head", "dim")
HND = (1, 0, 2)  # the canonical (token, head, dim) axes in HND memory order


class Preset(NamedTuple):
    name: str
    about: str
    build: Callable[[int, int], list[RegionSpec]]  # (layers, model page tokens) -> specs
    layers: int
    page: int
    tokens: int
    tp: str


def _kv(layer: int, page: int, heads: int, dim: int) -> list[RegionSpec]:
    return kv_layer(layer, page, heads, dim, axes=KV_AXES)


def tiny(layers: int, page: int) -> list[RegionSpec]:
    """A miniature GDN hybrid: attention on every second layer, recurrent state on the rest."""
    specs: list[RegionSpec] = []
    for layer in range(layers):
        specs += _kv(layer, page, 4, 32) if layer % 2 else gdn_layer(layer, (16, 16, 16), 4, 8)
    return specs


def llama70b(layers: int, page: int) -> list[RegionSpec]:
    """GQA dense: 8 KV heads of 128, bf16, k and v per layer."""
    return [s for layer in range(layers) for s in _kv(layer, page, 8, 128)]


def mla(layers: int, page: int) -> list[RegionSpec]:
    """DeepSeek-V3-shaped MLA: one latent of 512 + 64 rope dims per token, bf16, replicated on
    every TP rank (each decode rank reads it from one prefill rank)."""
    return [
        RegionSpec(
            pool="kv", name="latent", layer=layer, shape=(page, 576), axes=(PAGE_AXIS, "dim")
        )
        for layer in range(layers)
    ]


def qwen3next(layers: int, page: int) -> list[RegionSpec]:
    """Qwen3-Next-shaped GDN hybrid: full attention (2 KV heads of 256) on every 4th layer,
    gated delta net on the rest (conv ``[3, q 2048 | k 2048 | v 4096]``, 32 temporal heads of
    128 x 128 fp32)."""
    specs: list[RegionSpec] = []
    for layer in range(layers):
        attention = layer % 4 == 3
        specs += (
            _kv(layer, page, 2, 256) if attention else gdn_layer(layer, (2048, 2048, 4096), 32, 128)
        )
    return specs


LFM2_ATTENTION = frozenset({2, 5, 8, 10, 12, 14})  # of 16 layers; the pattern repeats


def lfm2(layers: int, page: int) -> list[RegionSpec]:
    """LFM2-shaped short-conv hybrid: attention (8 KV heads of 64) on 6 of 16 layers, a short
    convolution (state ``[2, 2048]``) on the rest, whose temporal state is registered empty as
    such engines do: the manifest drops it (reported), nothing moves for it."""
    specs: list[RegionSpec] = []
    for layer in range(layers):
        if layer % 16 in LFM2_ATTENTION:
            specs += _kv(layer, page, 8, 64)
            continue
        specs += [
            RegionSpec(pool="state", name="conv", layer=layer, shape=(2, 2048), tp_axis=1),
            RegionSpec(pool="state", name="temporal", layer=layer, shape=(0,), itemsize=2),
        ]
    return specs


PRESETS = {
    p.name: p
    for p in (
        Preset("tiny", "4-layer GDN hybrid in miniature (seconds)", tiny, 4, 16, 256, "2:4"),
        Preset(
            "llama70b",
            "GQA dense, Llama-70B shape (80 layers, 8 KV heads)",
            llama70b,
            80,
            16,
            1024,
            "2:2",
        ),
        Preset(
            "mla",
            "MLA, DeepSeek-V3 shape (61 layers, latent 576, replicated)",
            mla,
            61,
            64,
            1024,
            "2:2",
        ),
        Preset(
            "qwen3next",
            "GDN hybrid, Qwen3-Next shape (48 layers, 1 in 4 attention)",
            qwen3next,
            48,
            16,
            1024,
            "2:2",
        ),
        Preset(
            "lfm2",
            "short-conv hybrid, LFM2 shape (16 layers, empty temporal state)",
            lfm2,
            16,
            16,
            1024,
            "2:2",
        ),
    )
}


def shaped(
    preset: Preset, layers: int, pages: tuple[int, int], layouts: tuple[str, str]
) -> list[RegionSpec]:
    """The preset's specs with prefill/decode page sizes (tokens) and layouts ("nhd"/"hnd").

    ValueError for pages that do not divide one another, or a layout the model has no head
    axis for (MLA)."""
    lo, hi = sorted(pages)
    if lo < 1 or hi % lo:
        raise ValueError(
            f"page sizes {pages[0]}:{pages[1]}: the larger must be a multiple of the smaller"
        )
    specs = preset.build(layers, lo)
    has_heads = any(s.axes == KV_AXES for s in specs)
    if "hnd" in layouts and not has_heads:
        raise ValueError(f"preset {preset.name} has no head axis: --layout hnd does not apply")
    out = []
    for s in specs:
        if s.axes is not None:
            orders = [HND if (lay == "hnd" and s.axes == KV_AXES) else None for lay in layouts]
            s = msgspec.structs.replace(
                s,
                src_order=orders[0],
                dst_order=orders[1],
                src_pages=pages[0] // lo,
                dst_pages=pages[1] // lo,
            )
        out.append(s)
    return out


def stage_layers(layers: list[int], pp: int) -> dict[int, int]:
    """Layer -> pipeline stage: contiguous, nearly even, as engines split them."""
    ordered = sorted(set(layers))
    return {layer: i * pp // len(ordered) for i, layer in enumerate(ordered)}
