"""Named model layouts for the reference model: what real hybrids register, in miniature."""

from __future__ import annotations

from .reference import RegionSpec


def gdn_hybrid(
    layers: int = 4,
    *,
    attention_every: int = 2,
    page: int = 8,
    kv_heads: int = 4,
    head_dim: int = 16,
    conv_groups: tuple[int, int, int] = (16, 16, 16),
    state_heads: int = 4,
    state_dim: int = 8,
) -> list[RegionSpec]:
    """A gated-delta-net hybrid: every ``attention_every``-th layer is full attention.

    Attention layers hold GQA KV pages ``[page, heads, head_dim]`` sharded on
    heads. Recurrent layers hold a conv state ``[3, q|k|v]`` sharded in shard
    groups, a temporal state ``[heads, dim, dim]`` sharded on heads, and a
    short-conv entry with a degenerate shape, as some models register: the
    manifest must drop it.
    """
    specs: list[RegionSpec] = []
    for layer in range(layers):
        if layer % attention_every == attention_every - 1:
            specs += kv_layer(layer, page, kv_heads, head_dim)
        else:
            specs += gdn_layer(layer, conv_groups, state_heads, state_dim)
            specs.append(
                RegionSpec(pool="state", name="sconv", layer=layer, shape=(0, 0), itemsize=4)
            )
    return specs


def kv_layer(
    layer: int, page: int, heads: int, dim: int, axes: tuple[str, ...] | None = None
) -> list[RegionSpec]:
    """One attention layer: GQA pages ``[page, heads, dim]`` of k and v, sharded on heads."""
    return [
        RegionSpec(pool="kv", name=n, layer=layer, shape=(page, heads, dim), tp_axis=1, axes=axes)
        for n in ("k", "v")
    ]


def gdn_layer(
    layer: int, conv_groups: tuple[int, int, int], heads: int, dim: int
) -> list[RegionSpec]:
    """One gated-delta-net layer: conv state ``[kernel - 1, q | k | v]`` sharded in shard
    groups, temporal state ``[heads, dim, dim]`` (fp32) sharded on heads."""
    return [
        RegionSpec(
            pool="state",
            name="conv",
            layer=layer,
            shape=(3, sum(conv_groups)),
            tp_axis=1,
            tp_groups=conv_groups,
        ),
        RegionSpec(
            pool="state", name="temporal", layer=layer, shape=(heads, dim, dim), itemsize=4,
            tp_axis=0,
        ),
    ]  # fmt: skip
