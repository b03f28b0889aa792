"""benchmarks/bench_startup.py runs each case in fresh interpreters and reports every phase:
one repeat of the loopback and NIXL cases, one rank and two ranks started together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_startup.py"


def test_every_case_reports_its_phases(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--repeat", "1", "--ranks", "1,2",
         "--drivers", "loopback,nixl", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["ranks"], r["driver"], r["case"]): r for r in rows}
    kinds = {"loopback": ("raw", "xferkit"), "nixl": ("raw", "meta", "xferkit")}
    assert set(cases) == {(n, d, c) for n in (1, 2) for d, ks in kinds.items() for c in ks}
    for (ranks, _driver, case), r in cases.items():
        assert r["runs"] == ranks
        if case == "xferkit":
            assert all(r[p] > 0 for p in ("import", "open", "session", "close")), r
            assert r["worst"] >= r["total"] > r["import"]
    assert cases[(1, "nixl", "raw")]["open"] > 0  # the agent really came up
