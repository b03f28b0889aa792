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


def _run(script: str, *args: str) -> str:
    """Run an example as a user would; it must exit 0. Returns its stdout."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def test_short_conv_hybrid_drops_the_empty_temporal_state_and_moves_the_conv_bytes() -> None:
    out = _run("short_conv_hybrid.py")
    assert (
        "dropped 42 regions: state/temporal[0], state/temporal[1], ..., state/temporal[41]" in out
    )
    assert "zero-size axis" in out and "kept 168 conv regions" in out
    assert "-> decode slot 3: 16128 B" in out  # 42 layers x 4 streams x 16 x 3 bf16
    assert "decode holds all 4 conv streams of 42 layers byte-exact" in out


@pytest.mark.parametrize(("tp", "ranks", "each"), [("4:2", 4, 3360), ("2:4", 2, 6720)])
def test_gdn_hybrid_across_tp_sizes(tp: str, ranks: int, each: int) -> None:
    out = _run("gdn_hybrid.py", "--tp", tp)
    src, dst = tp.split(":")
    assert out.count(f": {each} B to decode") == ranks  # every prefill rank wrote its shard
    assert f"TP {src} -> {dst}: every decode rank holds its KV and GDN state byte-exact" in out


@pytest.mark.parametrize("driver", ["loopback", "mooncake", "nixl"])
def test_gqa_dense_over_each_driver(driver: str) -> None:
    out = _run("gqa_dense.py", "--driver", driver)
    assert f"{driver}: TP 8 -> 4, 4 pages, 262144 B moved" in out
    assert "all 4 decode ranks hold their heads of the prefill pages byte-exact" in out
