"""Group bootstrap, leases and reconnect backoff.

A prefill instance reached through one group address (every rank its own
process, on the loopback, Mooncake over TCP and NIXL), a hold that expires
unclaimed or is renewed, and a restarted prefill rank found again through the
group after the pair backed off.
"""

from __future__ import annotations

import time

import pytest
from session_rank import (
    BACKENDS,
    Check,
    Expect,
    Offer,
    RankProcess,
    Renew,
    Setup,
    Wait,
    Write,
    past_handshake,
    start,
)

from xferkit import Backend
from xferkit.session import RequestError, Session, State
from xferkit.session.backoff import Backoff
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 3.0}
SLOTS = {"kv": 8, "state": 4}


def _group(
    src_tp: int, dst_tp: int, session: dict[str, float], backend: str = "loopback"
) -> tuple[list[RankProcess], list[RankProcess]]:
    """Prefill rank 0 first (it serves the roster), then the other prefill ranks joining it."""
    opts = BACKENDS[backend]
    (first,) = start([Setup("src", 0, src_tp, dst_tp, backend, opts, session=session)])
    rest = start(
        [
            Setup("src", i, src_tp, dst_tp, backend, opts, session=session, group=first.address)
            for i in range(1, src_tp)
        ]
        + [Setup("dst", i, src_tp, dst_tp, backend, opts, session=session) for i in range(dst_tp)]
    )
    return [first, *rest[: src_tp - 1]], rest[src_tp - 1 :]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_decode_rank_reaches_every_prefill_rank_through_one_group_address(backend: str) -> None:
    pre, dec = _group(2, 1, FAST, backend)
    group = "group+" + pre[0].address
    try:
        dec[0].ok(Expect("r", [group], {"kv": [3, 4], "state": [1]}))
        for p in pre:
            p.ok(Offer("r"))
            p.ok(Write("r", {"kv": [0, 1], "state": [2]}, last=True))
        assert dec[0].ok(Wait("r", 5)).state == "DONE"
        assert all(p.ok(Wait("r", 5)).state == "DONE" for p in pre)
        dec[0].ok(Check({"kv": ([0, 1], [3, 4]), "state": ([2], [1])}))  # both halves landed
        # a group address and an explicit address list reach the same ranks
        dec[0].ok(Expect("r2", [p.address for p in pre], {"kv": [5]}))
        for p in pre:
            p.ok(Offer("r2"))
            p.ok(Write("r2", {"kv": [6]}, last=True))
        assert dec[0].ok(Wait("r2", 5)).state == "DONE"
        dec[0].ok(Check({"kv": ([0, 1, 6], [3, 4, 5]), "state": ([2], [1])}))
    finally:
        for p in pre + dec:
            p.close()


def test_a_restarted_group_rank_serves_the_next_request_after_backoff() -> None:
    pre, dec = _group(2, 1, FAST)
    group = "group+" + pre[0].address
    try:
        dec[0].ok(Expect("r1", [group], {"kv": [1]}))
        pre[0].ok(Offer("r1"))
        assert past_handshake(dec[0], "r1") == "WAITING"
        pre[1].kill()
        failed = dec[0].ok(Wait("r1", 5))
        assert failed.state == "FAILED" and failed.stage == "peer lost", failed
        assert pre[1].address in failed.error
        # the restarted rank binds a new address and joins the roster again
        (again,) = start([Setup("src", 1, 2, 1, session=FAST, group=pre[0].address)])
        pre[1] = again
        restarted = time.monotonic()
        dec[0].ok(Expect("r2", [group], {"kv": [2, 3]}))
        for p in pre:
            p.ok(Offer("r2"))
            p.ok(Write("r2", {"kv": [4, 5]}, last=True))
        assert dec[0].ok(Wait("r2", 10)).state == "DONE"
        assert time.monotonic() - restarted < FAST["dead_after_s"] + 2.0
        dec[0].ok(Check({"kv": ([4, 5], [2, 3])}))
    finally:
        for p in pre + dec:
            p.close()


def test_an_incomplete_group_fails_the_request_naming_the_missing_ranks() -> None:
    quick = {**FAST, "handshake_timeout_s": 0.6}
    (lonely, dec) = start(
        [Setup("src", 0, 2, 1, session=quick), Setup("dst", 0, 2, 1, session=quick)]
    )
    try:
        dec.ok(Expect("r", ["group+" + lonely.address], {"kv": [1]}))
        reply = dec.ok(Wait("r", 5))
        assert reply.state == "FAILED" and reply.stage == "handshake", reply
        assert "1 of 2 ranks joined" in reply.error and lonely.address in reply.error
    finally:
        lonely.close()
        dec.close()


def test_a_renewed_hold_outlives_its_lease_and_is_written_when_claimed() -> None:
    pre, dec = start(
        [
            Setup("src", 0, 1, 1, session={**FAST, "lease_s": 1.5}),
            Setup("dst", 0, 1, 1, session=FAST),
        ]
    )
    try:
        pre.ok(Offer("r"))
        pre.ok(Write("r", {"kv": [7], "state": [3]}, last=True))  # prefill finished first
        # The first Renew waits for the pair's handshake: a lease of 1.5 s leaves room for a
        # loaded machine's. 3.6 s, over twice the lease.
        for _ in range(12):
            dec.ok(Renew("r", [pre.address]))
            time.sleep(0.3)
        assert pre.ok(Wait("r", 0.01)).state == "WAITING"
        dec.ok(Expect("r", [pre.address], {"kv": [2], "state": [0]}))
        assert dec.ok(Wait("r", 5)).state == "DONE"
        assert pre.ok(Wait("r", 5)).state == "DONE"
        dec.ok(Check({"kv": ([7], [2]), "state": ([3], [0])}))
    finally:
        pre.close()
        dec.close()


def _pair(lease_s: float) -> tuple[Reference, MockDriver, Session, Session]:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    src = MockDriver()
    pre = Session(Backend(src), ref.srcs[0].manifest, heartbeat_s=0.2, lease_s=lease_s)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, heartbeat_s=0.2)
    return ref, src, pre, dec


def test_an_unclaimed_hold_expires_with_stage_timeout_on_both_sides_and_writes_nothing() -> None:
    ref, src, pre, dec = _pair(lease_s=0.3)
    try:
        send = pre.offer("r")
        send.write({"kv": [1, 2]}, last=True)
        started = time.monotonic()
        with pytest.raises(RequestError, match=r"lease_s=0\.3") as info:
            send.wait(5)
        assert 0.25 < time.monotonic() - started < 2.0
        assert info.value.stage == "timeout" and send.poll() is State.FAILED
        recv = dec.expect("r", pre.address, {"kv": [5, 6]})  # the decode side comes too late
        with pytest.raises(RequestError) as late:
            recv.wait(5)
        assert late.value.stage == "timeout" and str(late.value) == str(info.value)
        assert not src.of("post") and not src.of("notify")  # nothing was ever written
        ref.check(0, {})
    finally:
        pre.close()
        dec.close()


def test_backoff_doubles_up_to_its_bound_and_never_blacklists() -> None:
    backoff = Backoff()
    delays = [backoff.failed(0.0, 0.1, 1.0) for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(d <= 1.0 for d in delays) and max(delays) >= 0.5
    assert backoff.retry_at <= 1.0  # the next try is always at most the bound away
