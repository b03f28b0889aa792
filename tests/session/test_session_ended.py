"""A driver whose ends are not final (``capabilities.ends_are_final=False``: NIXL over UCX's
TCP transport, where releasing a request in flight lets its queued puts go out): a decode
rank that aborts a request reports FAILED only once the prefill's ``Ended`` notification
landed behind the last of those bytes, so slots reused at FAILED stay as the engine left
them. Every rank its own process, real ZMQ, a real NIXL agent each."""

from __future__ import annotations

import time

import pytest
from session_rank import BACKENDS, Abort, Expect, Fill, Offer, Setup, Stray, Wait, Write, ranks

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 5.0}
SLOTS = {"kv": 160, "state": 8}
KV = list(range(160))  # 1 MiB a page: 160 MiB, about 150 ms over UCX's TCP on this host


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP on 127.0.0.1 in every rank process (they inherit the environment)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def test_an_aborted_request_is_failed_once_its_writes_queued_bytes_landed() -> None:
    """The engine aborts a request 20 ms into a 160 MiB write; the prefill releases its NIXL
    requests (UCX still sends what they queued), posts ``Ended`` and acknowledges; the decode
    rank says FAILED once ``Ended`` landed, the engine reuses the slots at once, and nothing
    lands in them afterwards. Before, the decode rank said FAILED at the acknowledgement and
    the rest of the write landed in the reused slots."""
    setups = [
        Setup(role, 0, 1, 1, "nixl", BACKENDS["nixl"], session=FAST, page=2048, slots=SLOTS)
        for role in ("src", "dst")
    ]
    with ranks(*setups) as (pre, dec):
        dec.ok(Expect("warm", [pre.address], {"kv": [0]}))  # the pair and UCX's links up
        pre.ok(Offer("warm"))
        pre.ok(Write("warm", {"kv": [0]}, last=True))
        assert dec.ok(Wait("warm", 10)).state == "DONE"
        dec.ok(Expect("r", [pre.address], {"kv": KV}))
        pre.ok(Offer("r"))
        deadline = time.monotonic() + 10
        while dec.ok(Wait("r", 0.05)).state == "HANDSHAKING":
            assert time.monotonic() < deadline, "r never got past its handshake"
        pre.ok(Write("r", {"kv": KV}, last=True))
        time.sleep(0.02)
        aborted = time.monotonic()
        got = dec.ok(Abort("r", 10))
        took = time.monotonic() - aborted
        if got.state == "FAILED":
            dec.ok(Fill({"kv": KV}, 7))  # the engine reuses the slots at once
        time.sleep(1.0)  # what UCX still had queued has gone out by now
        assert got.state == "FAILED", f"not FAILED 10 s after the abort: {got}"
        assert took < 5.0, f"FAILED {took:.1f} s after the abort: the drain bound, not Ended"
        stray = dec.ok(Stray({"kv": KV}, 7))
        assert stray.count == 0, f"{stray.count} of {stray.total} bytes landed after FAILED"
        assert pre.ok(Wait("r", 5)).state == "FAILED"
        dec.ok(Expect("next", [pre.address], {"kv": [1]}))  # the pair still works
        pre.ok(Offer("next"))
        pre.ok(Write("next", {"kv": [1]}, last=True))
        assert dec.ok(Wait("next", 10)).state == "DONE"
