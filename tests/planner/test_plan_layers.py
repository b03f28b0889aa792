"""``Plan.expand(request, layers)`` / ``StagedPlan.expand(..., layers=)``: a layer-wise chunk's
copies are exactly the whole chunk's copies of those layers' regions; over any partition of
the layers they add up to the whole chunk, byte for byte (checked on the reference model)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.copier import copy_pieces
from xferkit.staging import StagedPlan, stage
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 8, "state": 4}
REQUEST = {"kv": ([0, 3, 5], [6, 1, 2]), "state": ([2], [0])}


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(range(4)),
    cuts=st.sets(st.integers(1, 3)),
    tp=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 4)]),
)
def test_any_partition_of_the_layers_moves_the_whole_chunk(
    order: list[int], cuts: set[int], tp: tuple[int, int]
) -> None:
    bounds = [0, *sorted(cuts), 4]
    parts = [frozenset(order[a:b]) for a, b in itertools.pairwise(bounds)]
    ref = Reference(gdn_hybrid(4), src_tp=tp[0], dst_tp=tp[1], src_slots=SLOTS, dst_slots=SLOTS)
    for s in ref.srcs:
        for d in ref.dsts:
            plan = xk.plan(s.manifest, d.manifest)
            whole = plan.expand(REQUEST)
            got = [plan.expand(REQUEST, part) for part in parts]
            assert sum(int(g.nbytes.sum()) for g in got) == int(whole.nbytes.sum())
            for part, g in zip(parts, got, strict=True):
                for key, arr in d.arrays.items():  # every copy lands in its layers' regions
                    lo, hi = arr.ctypes.data, arr.ctypes.data + arr.nbytes
                    inside = (g.dst >= lo) & (g.dst < hi)
                    assert key[2] in part or not inside.any(), (key, part)
                copy_pieces(g.src, g.dst, g.nbytes)
            staged = stage(plan, descriptor_bytes=4096, force="staged")
            assert sum(_staging(staged, p) for p in parts) == _staging(staged, None)
    for index in range(len(ref.dsts)):  # the direct copies of every part, applied: exact
        ref.check(index, REQUEST)


def _staging(staged: StagedPlan, layers: frozenset[int] | None) -> int:
    """Staging bytes the rounds of ``REQUEST`` (of ``layers``) use, both sides."""
    req = staged.expand(REQUEST, src_capacity=1 << 20, dst_capacity=1 << 20, layers=layers)
    return sum(r.src_bytes + r.dst_bytes for r in req.rounds)


def test_layers_of_no_region_move_nothing() -> None:
    ref = Reference(gdn_hybrid(4), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    plan = xk.plan(ref.srcs[0].manifest, ref.dsts[0].manifest)
    assert len(plan.expand(REQUEST, frozenset({99}))) == 0
    assert plan.layers("kv") == frozenset({1, 3}) and plan.layers("state") == frozenset({0, 2})
    assert np.array_equal(plan.expand(REQUEST, frozenset(range(4))).dst, plan.expand(REQUEST).dst)
