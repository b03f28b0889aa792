"""The bench's byte check: it passes after a correct handoff and catches any wrong byte."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.bench.content import Checker
from xferkit.bench.models import PRESETS, shaped
from xferkit.bench.ranks import build_rank
from xferkit.testing.reference import execute


@settings(max_examples=15, deadline=None)
@given(
    tp=st.sampled_from([(1, 1), (2, 4), (4, 2), (1, 2), (2, 1)]),
    pages=st.sampled_from([(16, 16), (16, 32), (32, 16)]),
    layout=st.sampled_from([("nhd", "nhd"), ("nhd", "hnd"), ("hnd", "nhd")]),
    seed=st.integers(0, 2**16),
)
def test_the_check_passes_after_the_plans_copies_and_catches_one_wrong_byte(
    tp: tuple[int, int], pages: tuple[int, int], layout: tuple[str, str], seed: int
) -> None:
    specs = shaped(PRESETS["tiny"], 4, pages, layout)
    slots = {"kv": 16, "state": 4}
    srcs = [
        build_rank(specs, "src", tp_rank=i, tp_size=tp[0], pp_rank=0, pp_size=1, slots=slots)
        for i in range(tp[0])
    ]
    dsts = [
        build_rank(specs, "dst", tp_rank=j, tp_size=tp[1], pp_rank=0, pp_size=1, slots=slots)
        for j in range(tp[1])
    ]
    rng = np.random.default_rng(seed)
    n_src = 4 if pages[1] >= pages[0] else 2  # 64 tokens
    n_dst = 4 * pages[0] // pages[1] if pages[1] >= pages[0] else 4
    request = {
        "kv": (rng.permutation(16)[:n_src].tolist(), rng.permutation(16)[:n_dst].tolist()),
        "state": ([int(rng.integers(4))], [int(rng.integers(4))]),
    }
    for j, d in enumerate(dsts):
        for s in srcs:
            p = xk.plan(s.manifest, d.manifest)
            if not p.empty:
                execute(p.expand(request))
        checker = Checker(specs, j, tp[1])
        checker.check(d.arrays, request)
        key = sorted(k for k, a in d.arrays.items() if a.size)[int(rng.integers(4))]
        cell = d.arrays[key][request[key[0]][1][0]].reshape(-1)
        at = int(rng.integers(cell.size))
        cell[at] ^= 0xFF
        try:
            checker.check(d.arrays, request)
        except AssertionError as exc:
            assert key[1] in str(exc)
        else:
            raise AssertionError(f"a flipped byte of {key} went unnoticed")
        checker.reset(d.arrays, request)
        try:  # nothing written: every requested page differs
            checker.check(d.arrays, request)
        except AssertionError:
            pass
        else:
            raise AssertionError("zeroed pages passed the check")
