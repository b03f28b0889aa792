"""benchmarks/soak_hosts.py, briefly: ranks on their own hosts, faults every other round.

The soak itself runs for minutes (docs/reliability.md has its results); this runs it for a
few seconds so that it keeps working, and checks what it promises to check: the requests
that ended DONE hold the reference bytes, no byte lands outside the slots a request holds,
and every window reports requests, faults, RSS and fds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak_hosts.py"


def test_a_short_soak_with_faults_checks_every_byte_and_reports_its_windows(
    tmp_path: Path,
) -> None:
    out = tmp_path / "soak.json"
    args = ["--driver", "mooncake", "--seconds", "8", "--prefill", "1", "--decode", "2"]
    args += ["--fault-every", "2", "--window", "4", "--seed", "3", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 2, rows  # a window every 4 s
    assert sum(r["done"] for r in rows) > 0, rows
    assert sum(sum(r["faults"].values()) for r in rows) > 0, rows
    for r in rows:
        assert r["wrong"] == 0 and r["stray"] == 0, r
        assert r["refused"] == {}, r
        assert r["rss_mib"] > 0 and r["fds"] > 0, r
    assert "max RSS MiB" in run.stdout
