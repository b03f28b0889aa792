"""benchmarks/bench_engine_load.py: each shape's rows on a driver, the load rows byte-checked,
the one large request's not (its checks used to run inside its span, one request at a
time, so ``vs 1 large`` divided by the checker's speed as much as the transfer's), and each
load row compared with one large request on the same machine (a busy load row was divided
by the quiet large request's rate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_engine_load.py"


def test_every_shape_gets_its_rows_and_each_load_is_compared_on_its_own_machine(
    tmp_path: Path,
) -> None:
    out = tmp_path / "engine_load.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--shapes", "tiny,llama70b:2", "--requests", "6",
         "--concurrency", "6", "--min-tokens", "16", "--tokens", "256", "--large-tokens", "512",
         "--hogs", "1", "--drivers", "loopback", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["shape"], r["machine"]) for r in rows] == [
        (model, shape, machine)
        for model in ("tiny", "llama70b:2")
        for machine in ("quiet", "busy")
        for shape in ("one large", "16-256 tokens")
    ]  # fmt: skip
    for r in rows:
        assert r["failed"] == 0 and not r["error"], r
        large = r["shape"] == "one large"
        assert r["done"] == (3 if large else 6)
        assert r["verified"] is (None if large else True), r
        # What the rank processes spent on the measured requests, per role and per GB (read
        # in the kernel's 10 ms ticks: a role's share of a short row may round to none).
        used, per = r["cpu_s"], r["cpu_s_per_gb"]
        assert used["prefill"] >= 0 and used["decode"] >= 0 and sum(used.values()) > 0, r
        moved = r["gbps"] * r["span_s"]
        assert per["all"] == pytest.approx((used["prefill"] + used["decode"]) / moved)
        for role, kinds in r["cpu_threads_s"].items():  # split by the threads' OS names
            assert set(kinds) == {"engine", "control", "data", "pack", "zmq", "bench",
                                  "driver", "all"}  # fmt: skip
            assert kinds["all"] == pytest.approx(used[role])
            parts = sum(v for k, v in kinds.items() if k != "all")
            assert parts == pytest.approx(kinds["all"], abs=0.05), kinds  # ticks apart
    for large, load in zip(rows[0::2], rows[1::2], strict=True):
        assert large["machine"] == load["machine"]
        assert load["vs_large"] == pytest.approx(load["gbps"] / large["gbps"])


def test_a_case_says_when_its_ranks_are_up_before_any_request() -> None:
    """``run_case(ready=)`` is where the busy rows start their hogs: after every rank has
    built its pools (under two hogs, on this VM, the decode ranks' first touch of theirs
    took longer than the 120 s a rank has to start, and every busy load row failed), and
    before the warm-up request, so that the requests all run on the busy machine."""
    import multiprocessing as mp
    import time

    from xferkit.bench.handoff import Case, Workload, run_case
    from xferkit.bench.models import PRESETS, shaped

    p = PRESETS["tiny"]
    specs = shaped(p, p.layers, (p.page, p.page), ("nhd", "nhd"))
    seen: list[tuple[int, float]] = []

    def ready() -> None:
        seen.append((len(mp.active_children()), time.monotonic()))

    work = Workload(specs, 64, (p.page, p.page), 3, 1, 1)
    result = run_case(Case("loopback", (1, 2)), work, ready=ready)
    assert len(seen) == 1, seen
    alive, at = seen[0]
    assert alive >= 3  # the prefill rank and both decode ranks
    starts = [start for r in result.records for start, _ in r.decode + r.prefill]
    assert len(result.records) == 4 and starts  # the warm-up and three measured
    assert at < min(starts)
