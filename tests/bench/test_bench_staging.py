"""benchmarks/bench_staging.py: every case's route efficiency is taken against the
one-descriptor request of its own size, run in the same rounds, and the raw driver costs
come from writes into a peer process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_staging.py"


def test_route_efficiency_is_against_one_descriptor_of_the_same_size(tmp_path: Path) -> None:
    out = tmp_path / "staging.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--drivers", "loopback", "--layers", "1", "--tokens", "256",
         "--repeat", "1", "--no-views", "--only", "8 -> 4 NHD staged", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {
        "8 -> 8 NHD", "8 -> 4 NHD staged", "one descriptor, TP 8", "one descriptor, TP 4",
    }  # fmt: skip
    for case, tp in (("8 -> 8 NHD", 8), ("8 -> 4 NHD staged", 4)):
        one = rows[f"one descriptor, TP {tp}"]
        assert one["bytes"] == rows[case]["bytes"]  # the same size: half as much at TP 8
        assert one["routes"] == ["direct"] and one["vs_one"] == 1
        assert rows[case]["vs_one"] == pytest.approx(rows[case]["gbps"] / one["gbps"])
    assert rows["8 -> 4 NHD staged"]["routes"] == ["unpack"]
    assert rows["8 -> 4 NHD staged"]["bytes"] == 2 * rows["8 -> 8 NHD"]["bytes"]
    (costs,) = data["meta"]["costs"]
    assert costs["driver"] == "loopback" and costs["gbps_paged"] > 0 and costs["gbps_whole"] > 0
    assert costs["paged_vs_one"] == pytest.approx(costs["gbps_paged"] / costs["gbps_whole"])
