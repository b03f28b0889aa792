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
    for large, load in zip(rows[0::2], rows[1::2], strict=True):
        assert large["machine"] == load["machine"]
        assert load["vs_large"] == pytest.approx(load["gbps"] / large["gbps"])
