"""A driver that fences (``capabilities.fencing``: the TCP example): a decode rank that loses
a source cuts its connections and says FAILED at once, not after the source's drain bound,
and nothing the source sends when it wakes lands. Every rank its own process, real ZMQ."""

from __future__ import annotations

import os
import signal
import time

from session_rank import (
    BACKENDS,
    Expect,
    Fill,
    Landed,
    Offer,
    Setup,
    Stray,
    Wait,
    Write,
    past_handshake,
    ranks,
)

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 3.0}
SLOTS = {"kv": 32, "state": 8}
KV = list(range(24))  # 1 MiB a page: 24 MiB, about 130 ms on this driver's wire


def test_a_frozen_prefill_is_fenced_failed_at_once_and_lands_nothing_when_it_wakes() -> None:
    """A prefill stopped (SIGSTOP) while it streams 24 MiB is lost after dead_after_s; the
    decode rank fences it and says FAILED then (on a driver that cannot fence it would drain
    to the prefill's bound, 71 s here); the engine reuses the slots; at SIGCONT the prefill
    sends the rest of its frame, refused: nothing lands. The next request pairs anew through
    the decode rank's new endpoint and lands."""
    pre_setup, dec_setup = (
        Setup(role, 0, 1, 1, "tcp-example", session=FAST, page=2048, slots=SLOTS)
        for role in ("src", "dst")
    )
    with ranks(pre_setup, dec_setup) as (pre, dec):
        dec.ok(Expect("r", [pre.address], {"kv": KV}))
        pre.ok(Offer("r"))
        past_handshake(dec, "r")
        pre.ok(Write("r", {"kv": KV}, last=True))  # posted: the sender's thread streams it
        time.sleep(0.03)
        os.kill(pre.proc.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            got = dec.ok(Wait("r", 10))
            failed_after = time.monotonic() - stopped
            reused = got.state == "FAILED"
            if reused:
                dec.ok(Fill({"kv": KV}, 7))  # the engine reuses the slots at once
        finally:
            os.kill(pre.proc.pid, signal.SIGCONT)
        time.sleep(1.0)  # what the prefill still had to send arrives now
        assert got.state != "DONE", "the write ended before SIGSTOP: nothing was in flight"
        assert reused, f"not FAILED 10 s after the stop (it drains to its bound): {got}"
        assert failed_after < 4 * FAST["dead_after_s"], (
            f"FAILED after {failed_after:.1f} s: the drain bound, not the fence"
        )
        assert "sent nothing" in got.failing or "sent nothing" in got.error, got
        stray = dec.ok(Stray({"kv": KV}, 7))
        assert stray.count == 0, f"{stray.count} of {stray.total} bytes landed after FAILED"
        assert pre.ok(Wait("r", 5)).state == "FAILED"
        # The next request pairs anew with the decode rank's new endpoint, and lands.
        dec.ok(Expect("r2", [pre.address], {"kv": [30, 31]}))
        pre.ok(Offer("r2"))
        pre.ok(Write("r2", {"kv": [0, 1]}, last=True))
        assert dec.ok(Wait("r2", 10)).state == "DONE"
        landed = dec.ok(Landed({"kv": ([0, 1], [30, 31])}))
        assert landed.count == landed.total > 0, landed


def test_a_fence_that_cuts_every_source_fails_the_others_requests_and_they_pair_anew() -> None:
    """Mooncake over TCP fences by retiring the engine every source writes to
    (``capabilities.fence_cuts_all``): a decode rank that loses one prefill rank cuts the
    other one's connections too. That one's request in flight turns FAILED at once on both
    sides, naming the lost rank, and its next request handshakes with the new endpoint and
    lands."""
    setups = [
        Setup(role, 0, 1, 1, "mooncake", BACKENDS["mooncake"], session=FAST, slots=SLOTS)
        for role in ("src", "src", "dst")
    ]
    with ranks(*setups) as (lost, other, dec):
        for i, pre in enumerate((lost, other)):  # both pairs up
            dec.ok(Expect(f"warm{i}", [pre.address], {"kv": [i]}))
            pre.ok(Offer(f"warm{i}"))
            pre.ok(Write(f"warm{i}", {"kv": [i]}, last=True))
            assert dec.ok(Wait(f"warm{i}", 10)).state == "DONE"
        dec.ok(Expect("r", [lost.address], {"kv": [4]}))
        dec.ok(Expect("cut", [other.address], {"kv": [5]}))
        other.ok(Offer("cut"))  # its data is not written yet
        past_handshake(dec, "r")
        past_handshake(dec, "cut")
        os.kill(lost.proc.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            got = dec.ok(Wait("r", 10))
            failed_after = time.monotonic() - stopped
            cut = dec.ok(Wait("cut", 5))
        finally:
            os.kill(lost.proc.pid, signal.SIGCONT)
        assert got.state == "FAILED", f"not FAILED 10 s after the stop: {got}"
        assert failed_after < 4 * FAST["dead_after_s"], f"FAILED after {failed_after:.1f} s"
        assert cut.state == "FAILED", cut
        assert "fences every peer at once" in cut.error and lost.address in cut.error, cut
        assert other.ok(Wait("cut", 5)).state == "FAILED"
        dec.ok(Expect("next", [other.address], {"kv": [6]}))
        other.ok(Offer("next"))
        other.ok(Write("next", {"kv": [2]}, last=True))
        assert dec.ok(Wait("next", 10)).state == "DONE"
        landed = dec.ok(Landed({"kv": ([2], [6])}))
        assert landed.count == landed.total > 0, landed
