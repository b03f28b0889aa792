"""The examples run as written and check their own results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("backend", ["loopback", "mooncake", "nixl"])
def test_handoff_example(backend: str) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "handoff.py"), backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "all decode ranks hold the prefill pages byte-exact" in run.stdout
    assert run.stdout.count("descriptors") == 4  # each decode rank needs exactly one source
