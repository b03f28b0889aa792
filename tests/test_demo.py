"""The main job, as the README's first command runs it: ``make demo`` is ``xferkit bench``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_demo_runs_the_bench_and_prints_a_checked_table() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/xferkit bench\n" in recipe + "\n"  # the tiny preset, every default
    run = subprocess.run(
        [sys.executable, "-m", "xferkit", "bench"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    row = next(line for line in run.stdout.splitlines() if "loopback tp 2:4 auto" in line)
    assert row.rstrip(" │").endswith("checked")
    assert re.search(r"\d+\.\d+ KiB", row)
    assert "decode rank 3 <- prefill rank 1" in run.stderr
