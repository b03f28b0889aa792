"""A large cross-process transfer cut short: by an abort, and by a SIGKILLed prefill.

The loopback is opened with ``max_batch=2`` and the request names 512 pages of
32 layers, so one request is ~8000 batches posted one after another (about a
second): the test sees it in flight (some bytes landed, not all) and cuts it there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from session_rank import (
    Abort,
    Check,
    Expect,
    Fill,
    Landed,
    Offer,
    RankProcess,
    Setup,
    Verify,
    Wait,
    Write,
    start,
)

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 2.0}
PAGES = 512
BIG = {"layers": 32, "slots": {"kv": PAGES, "state": 8}}
SRC = list(range(PAGES))
DST = [(7 * i) % PAGES for i in range(PAGES)]  # scattered: one descriptor per page and region
REUSED = 0x5A
FULL_TRANSFER_S = 3.0  # well above the ~1 s the whole request takes


def _setups() -> list[Setup]:
    opts = {"max_batch": 2}
    # Direct: one descriptor per page and region, thousands of batches (staged, the request
    # would be a few large copies, over before the test could cut it).
    session = {**FAST, "staging": "never"}
    return [
        Setup("src", 0, 1, 1, "loopback", opts, session=session, **BIG),  # type: ignore[arg-type]
        Setup("dst", 0, 1, 1, "loopback", opts, session=session, **BIG),  # type: ignore[arg-type]
    ]


@pytest.fixture
def pair() -> Iterator[tuple[RankProcess, RankProcess]]:
    pre, dec = start(_setups())
    yield pre, dec
    pre.close()
    dec.close()


def _start_big(pre: RankProcess, dec: RankProcess, rid: str) -> None:
    """Start the big request and return once it is visibly in flight (part landed)."""
    dec.ok(Expect(rid, [pre.address], {"kv": DST}))
    pre.ok(Offer(rid))
    pre.ok(Write(rid, {"kv": SRC}, last=True))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        landed = dec.ok(Landed({"kv": (SRC, DST)}))
        if landed.count:
            assert landed.count < landed.total, "the transfer finished before the test cut it"
            return
        time.sleep(0.005)
    raise AssertionError("nothing landed within 10 s")


def test_abort_mid_transfer_then_reused_slots_get_no_late_byte(
    pair: tuple[RankProcess, RankProcess],
) -> None:
    pre, dec = pair
    _start_big(pre, dec, "big")
    aborted = dec.ok(Abort("big"))
    assert (aborted.state, aborted.stage) == ("FAILED", "abort"), aborted
    dec.ok(Fill({"kv": DST}, REUSED))  # the engine hands the slots to another request at once
    # The prefill side failed with the same root cause, and its writes were drained.
    sent = pre.ok(Wait("big", 5))
    assert (sent.state, sent.stage, sent.error) == ("FAILED", "abort", aborted.error)
    time.sleep(FULL_TRANSFER_S)  # long enough for every remaining batch to have landed
    dec.ok(Verify({"kv": DST}, REUSED))
    # The pair is healthy: the same slots take the next request, byte-exact, nothing else touched.
    dec.ok(Expect("again", [pre.address], {"kv": DST}))
    pre.ok(Offer("again"))
    pre.ok(Write("again", {"kv": SRC}, last=True))
    assert dec.ok(Wait("again", 30)).state == "DONE"
    assert pre.ok(Wait("again", 5)).state == "DONE"
    dec.ok(Check({"kv": (SRC, DST)}))


def test_a_prefill_sigkilled_mid_transfer_fails_the_request_within_the_deadline(
    pair: tuple[RankProcess, RankProcess],
) -> None:
    pre, dec = pair
    _start_big(pre, dec, "big")
    pre.kill()
    killed = time.monotonic()
    reply = dec.ok(Wait("big", 10))
    took = time.monotonic() - killed
    assert (reply.state, reply.stage) == ("FAILED", "peer lost"), reply
    assert pre.address in reply.error and "prefill rank 0" in reply.error, reply.error
    assert took < 4 * FAST["dead_after_s"], took  # not request_timeout_s (60 s)
    # Nothing hangs: the decode rank answers and closes promptly.
    assert dec.ok(Wait("big", 0.1)).state == "FAILED"
    closing = time.monotonic()
    dec.close()
    assert dec.proc.returncode == 0 and time.monotonic() - closing < 5
