"""The coverage proof: every destination byte written exactly once, by the sources together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..errors import ArgumentError, PlanError
from ..manifest import STAGING_POOL, Manifest, key_label
from .pieces import EMPTY
from .plan import Plan, plan


class Coverage(NamedTuple):
    """Which sources a destination needs, with their plans, proven to write each byte once."""

    sources: tuple[int, ...]  # indices into the ``srcs`` given to ``coverage``
    plans: dict[int, Plan]


def coverage(srcs: Sequence[Manifest], dst: Manifest) -> Coverage:
    """Plan every source for ``dst`` and prove each destination byte is written exactly once.

    ``srcs`` are all the source ranks (every TP rank of every pipeline stage).
    Raises ``PlanError`` naming the region and byte range that would be left
    unwritten or written twice.
    """
    if (
        not isinstance(srcs, Sequence)
        or not all(isinstance(m, Manifest) for m in srcs)
        or not isinstance(dst, Manifest)
    ):
        raise ArgumentError(
            "coverage(srcs, dst) takes a sequence of source Manifests and one Manifest"
        )
    plans = {i: plan(m, dst) for i, m in enumerate(srcs)}
    for r in dst.regions:
        if r.pool == STAGING_POOL:
            continue
        writers = [i for i, p in plans.items() if p.pieces(r.key).src.size]
        starts, lengths = [], []
        for i in writers:
            alignment = plans[i].alignment(r.key)
            assert alignment is not None  # it has pieces
            t = alignment.pieces
            pages = np.arange(alignment.dst_pages, dtype=np.uint64) * np.uint64(alignment.dst_shift)
            starts.append((pages[:, None] + t.dst[None, :]).ravel())
            lengths.append(np.tile(t.nbytes, alignment.dst_pages))
        bad = _first_not_once(
            np.concatenate(starts or [EMPTY]).astype(np.int64),
            np.concatenate(lengths or [EMPTY]).astype(np.int64),
            r.slot_nbytes,
        )
        if bad is not None:
            first, end, n = bad
            what = "is written by no source" if n == 0 else f"is written {n} times"
            raise PlanError(
                f"region {key_label(r.key)}: bytes [{first}, {end}) of each slot {what} "
                f"(sources writing this region: {writers or 'none'})",
                subject=r.key,
            )
    used = tuple(i for i, p in plans.items() if not p.empty)
    return Coverage(used, {i: plans[i] for i in used})


def _first_not_once(
    starts: np.ndarray, nbytes: np.ndarray, size: int
) -> tuple[int, int, int] | None:
    """The first run of [0, size) not covered exactly once: (start, end, times), or None.

    A sweep over the pieces' edges: it costs what the pieces cost, not the slot size.
    """
    pos = np.concatenate([starts, starts + nbytes, [0, size]])
    delta = np.concatenate(
        [np.ones(starts.size, np.int64), -np.ones(starts.size, np.int64), [0, 0]]
    )
    order = np.argsort(pos, kind="stable")
    pos, delta = pos[order], delta[order]
    edges, first = np.unique(pos, return_index=True)
    level = np.cumsum(np.add.reduceat(delta, first))[:-1]  # over [edges[k], edges[k+1])
    wrong = np.flatnonzero((level != 1) & (edges[:-1] < size))
    if not wrong.size:
        return None
    k = int(wrong[0])
    n = int(level[k])
    change = np.flatnonzero(level[k:] != n)
    end = int(edges[k + int(change[0])]) if change.size else size
    return int(edges[k]), min(end, size), n
