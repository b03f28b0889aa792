"""An engine's load on every driver, in real processes: a GDN hybrid (KV pages, conv and
temporal state), prefill TP 2 -> decode TP 4, every request in three chunks plus its state
slot, 100 requests in flight at once, Session defaults.

Before, on this shape a third of the requests failed on Mooncake: fixed 16 MiB staging
slices served 4 chunks at a time and sent the rest the direct way (one descriptor per
64-byte token row), and a burst of commands held the heartbeats back until live peers were
declared lost. Every request must now end DONE, byte for byte, every chunk staged, and no
byte may be left in a decode slot after its request ended (the bench's audit).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("driver", ["loopback", "mooncake", "nixl"])
def test_a_hundred_concurrent_requests_all_done_byte_exact_and_staged(driver: str) -> None:
    run = subprocess.run(
        [
            sys.executable, "-m", "xferkit", "bench", "--preset", "tiny", "--tp", "2:4",
            "--requests", "100", "--concurrency", "100", "--chunks", "3", "--driver", driver,
            "--quiet", "--json", "-",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]  # 4: a request failed; 1: a byte differs
    (case,) = json.loads(run.stdout)["cases"]
    assert case["requests"] == 100 and case["verified"] is True
    assert case["direct_chunks"] == 0 and case["staged_chunks"] > 0, case
    for r in case["records"]:
        # 3 chunks from each of 2 prefill ranks to each of their 2 decode ranks
        assert r["routes"]["staged_chunks"] == 12, r["routes"]
