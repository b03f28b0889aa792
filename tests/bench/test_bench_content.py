"""The bench's byte check: it passes after a correct handoff and catches any wrong byte."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.bench.content import Checker
from xferkit.bench.models import PRESETS, shaped
from xferkit.bench.ranks import build_rank
from xferkit.testing.reference import Blocks, execute


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


def test_a_bench_rank_puts_its_small_pools_on_page_boundaries_as_an_engine_does() -> None:
    """numpy alone put a small pool (the prefill's source pages) on the C heap, each region
    at its own offset within a page: a pack gathering from several of them took numpy's
    element-wise path, and the load's packs cost twice their bytes (docs/performance.md)."""
    specs = shaped(PRESETS["llama70b"], 4, (16, 16), ("nhd", "nhd"))
    slots = {"kv": 64}
    rank = build_rank(specs, "src", tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, slots=slots)
    held = {k: a for k, a in rank.arrays.items() if a.size}
    assert held and all(a.ctypes.data % 4096 == 0 for a in held.values())
    assert {r.key: r.addr for r in rank.manifest.regions} == {
        k: a.ctypes.data for k, a in held.items()
    }
    # The model's bytes are in the placed arrays: the whole request reaches a decode rank.
    dst = build_rank(specs, "dst", tp_rank=1, tp_size=4, pp_rank=0, pp_size=1, slots=slots)
    request = {"kv": (list(range(64)), list(range(63, -1, -1)))}
    execute(xk.plan(rank.manifest, dst.manifest).expand(request))
    Checker(specs, 1, 4).check(dst.arrays, request)


def test_blocks_carve_small_arrays_page_by_page_and_leave_large_ones_where_they_are() -> None:
    memory = Blocks(1 << 16, align=4096, keep_from=1 << 16)
    rng = np.random.default_rng(0)
    small = [rng.integers(0, 255, size=(n, 3), dtype=np.uint8) for n in (5, 1000, 7000, 12000)]
    placed = [memory(a) for a in small]
    for a, p in zip(small, placed, strict=True):
        assert p is not a and p.shape == a.shape and p.dtype == a.dtype
        assert np.array_equal(p, a) and p.ctypes.data % 4096 == 0
    at = [p.ctypes.data for p in placed]
    assert at[1] == at[0] + 4096 and at[2] == at[1] + 4096  # one block, page after page
    assert at[3] != at[2] + 24576  # that block is full: the next one
    large = np.ones(1 << 16, dtype=np.uint8)
    assert memory(large) is large


def test_blocks_without_alignment_lay_arrays_end_to_end() -> None:
    memory = Blocks(1 << 10)
    a, b = memory(np.ones((3, 5), dtype=np.uint8)), memory(np.zeros(7, dtype=np.uint8))
    assert b.ctypes.data == a.ctypes.data + 15 and a.sum() == 15 and not b.any()
