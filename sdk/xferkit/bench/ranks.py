"""One rank's buffers, shaped by the model: the reference model's layout, the bench's content."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ..testing.reference import Blocks, Rank, RegionSpec, Side
from .content import fill_source
from .models import stage_layers


class _Blank(Mapping):
    """Global tensors that are never built: broadcast zeros, so ``Rank`` allocates only its
    own shard (the content is written afterwards)."""

    def __init__(self, specs: list[RegionSpec], slots: Mapping[str, int], side: Side) -> None:
        self._by_key = {s.key: s for s in specs}
        self._slots, self._side = slots, side

    def __getitem__(self, key: object) -> np.ndarray:
        s = self._by_key[key]  # type: ignore[index]
        shape = (self._slots[s.pool], *s.side_shape(self._side), s.itemsize)
        return np.broadcast_to(np.zeros((), dtype=np.uint8), shape)

    def __iter__(self) -> Iterator:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)


POOL_BLOCK = 64 << 20
"""How the bench places a rank's small pools: page-aligned in blocks of this size, as an
engine's pools come from big allocations (torch's allocators) that the kernel maps on page
boundaries and backs with huge pages where it may. numpy alone put the small ones (the
prefill's source pages, a few MiB per region) on the C heap, each at its own offset within
a page and on 4 KiB pages: a pack gathering from several could not view them as one grid
of pieces and took numpy's slower element-wise path, which made the load's packs cost twice
their bytes (docs/performance.md). Pools of a block or more keep numpy's own allocation,
which is such a block already (copying them would touch their memory twice)."""


def pool_memory() -> Blocks:
    return Blocks(POOL_BLOCK, align=4096, keep_from=POOL_BLOCK)


def stage_specs(specs: list[RegionSpec], pp_rank: int, pp_size: int) -> list[RegionSpec]:
    stage = stage_layers([s.layer for s in specs], pp_size)
    return [s for s in specs if stage[s.layer] == pp_rank]


def build_rank(
    specs: list[RegionSpec],
    side: Side,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    slots: Mapping[str, int],
) -> Rank:
    """The rank's arrays and manifest; a prefill rank's hold the model's bytes, a decode
    rank's zeros."""
    mine = stage_specs(specs, pp_rank, pp_size)
    rank = Rank(
        mine,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_stage=pp_rank,
        fill=_Blank(mine, slots, side),
        side=side,
        place=pool_memory(),
    )
    if side == "src":
        for spec in mine:
            fill_source(spec, rank.arrays[spec.key], tp_rank, tp_size)
    return rank
