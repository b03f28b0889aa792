"""Random interleavings of expect / offer / write chunks / abort / time passing, a few requests.

Both sides run in one process over MockDriver (real copies, real sockets), the
prefill side with a short lease. The test keeps a model of each request's fate
and checks it exactly at the end:

* untouched: every handle DONE, every destination byte exact;
* aborted (before any other failure): a FAILED handle fails with stage abort,
  one text on every side (a handle that was DONE already stays DONE);
* lease expired: the last chunk was written while no decode rank had asked,
  and time passed beyond ``lease_s`` before one did. The Send fails with stage
  timeout, every decode rank that asks later fails with that same text, later
  aborts change nothing, and no destination byte was written.

The first ``Request`` from any decode rank claims a hold (docs/engine.md,
Leases): a request one decode rank asked for before the lease ran out is
completed when the others ask, however late.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from xferkit import Backend, XferError
from xferkit.session import Receive, RequestError, Send, Session, State
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver

SLOTS = {"kv": 64, "state": 16}
REQUESTS = 3
CHUNKS = 3
DECODE = 2  # decode TP size
LEASE_S = 0.3
PAST_LEASE_S = 0.4  # one wait_past_lease op: longer than the lease, well under everything else
WAITS = 2  # wait_past_lease ops honoured per example (the rest are no-ops): keeps it fast
STALL_S = LEASE_S / 3
"""A held request first asked for this long after its last chunk may have expired: a stalled
machine can put a lease's worth between two steps the test means to be instant."""
UNWRITTEN = 0xA5  # what a destination slot holds until a request writes it
_ids = itertools.count()


class Pair:
    """Prefill TP 1 -> decode TP 2 over MockDriver; the pairs are handshaken up front, so an
    expect starts at once (an abort during the handshake: see the test at the end)."""

    def __init__(self) -> None:
        self.ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=2, src_slots=SLOTS, dst_slots=SLOTS)
        self.pre = Session(Backend(MockDriver()), self.ref.srcs[0].manifest, lease_s=LEASE_S)
        self.dec = [Session(Backend(MockDriver()), d.manifest) for d in self.ref.dsts]
        recvs = [d.expect("warm-up", [self.pre.address], {"kv": [0]}) for d in self.dec]
        send = self.pre.offer("warm-up")
        send.write({"kv": [0]}, last=True)
        for h in (*recvs, send):
            h.wait(10)

    def close(self) -> None:
        for s in (self.pre, *self.dec):
            s.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


Op = tuple[str, int, int]  # (operation, request index, decode rank for expect_one)

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "expect",  # every decode rank not yet asking asks
                "expect_one",  # one decode rank asks
                "offer",
                "write",
                "write",
                "prefill",  # offer if not yet, then every chunk left, the last one included
                "abort_decode",
                "abort_prefill",
                "wait_past_lease",
            ]
        ),
        st.integers(0, REQUESTS - 1),
        st.integers(0, DECODE - 1),
    ),
    max_size=20,
)

_OFFER_AND_WRITE: list[Op] = [("offer", 0, 0)] + [("write", 0, 0)] * CHUNKS


def _slot_rows(ref: Reference, rank: int, slots: dict[str, list[int]]) -> Iterator[tuple]:
    """(region key, array, rows named by ``slots``) for every non-empty region of a dst rank."""
    for key, arr in ref.dsts[rank].arrays.items():
        if key[0] in slots and arr.size:
            yield key, arr, np.asarray(slots[key[0]], dtype=np.int64)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
# expired, then both decode ranks ask: both fail with the prefill's text
@example(ops=[*_OFFER_AND_WRITE, ("wait_past_lease", 0, 0), ("expect", 0, 0)])
# expired, one rank asks late, then both sides abort: nothing changes the root cause
@example(
    ops=[
        *_OFFER_AND_WRITE,
        ("wait_past_lease", 0, 0),
        ("expect_one", 0, 1),
        ("abort_decode", 0, 0),
        ("abort_prefill", 0, 0),
    ]
)
# one decode rank claimed the hold before it ran out: completed when the other asks
@example(ops=[*_OFFER_AND_WRITE, ("expect_one", 0, 1), ("wait_past_lease", 0, 0)])
# asked before the last chunk: never held, time passing changes nothing
@example(ops=[("expect_one", 0, 0), *_OFFER_AND_WRITE, ("wait_past_lease", 0, 0)])
# aborted while held: the abort, not the lease, is the root cause
@example(
    ops=[*_OFFER_AND_WRITE, ("abort_prefill", 0, 0), ("wait_past_lease", 0, 0), ("expect", 0, 0)]
)
# two holds: one claimed in time, one not; then a second wait for a third written later
@example(
    ops=[
        ("offer", 0, 0),
        ("offer", 1, 0),
        *[("write", k, 0) for k in (0, 1) for _ in range(CHUNKS)],
        ("expect", 1, 0),
        ("wait_past_lease", 0, 0),
        ("offer", 2, 0),
        *[("write", 2, 0)] * CHUNKS,
        ("expect_one", 0, 0),
        ("wait_past_lease", 0, 0),
    ]
)
# a stall the model does not know of between the last chunk and the first ask: it expired
@example(ops=[*_OFFER_AND_WRITE, ("stall", 0, 0), ("expect_one", 0, 0)])
def test_random_interleavings_end_in_the_right_states(pair: Pair, ops: list[Op]) -> None:
    run = next(_ids)
    rids = [f"i{run}-{k}" for k in range(REQUESTS)]
    # each request: kv slots in chunks, one state slot in the first chunk; distinct dst slots
    src = [{"kv": [3 * k + c for c in range(CHUNKS)], "state": [k]} for k in range(REQUESTS)]
    base = (run * REQUESTS) % (SLOTS["kv"] // CHUNKS - REQUESTS)
    dst = [
        {
            "kv": [CHUNKS * (base + k) + c for c in range(CHUNKS)][::-1],
            "state": [(run + k) % SLOTS["state"]],
        }
        for k in range(REQUESTS)
    ]
    for k, i in itertools.product(range(REQUESTS), range(DECODE)):  # no write in flight now
        for _, arr, rows in _slot_rows(pair.ref, i, dst[k]):
            arr[rows] = UNWRITTEN
    recvs: dict[int, dict[int, Receive]] = {k: {} for k in range(REQUESTS)}
    sends: dict[int, Send] = {}
    written = dict.fromkeys(range(REQUESTS), 0)
    fate: dict[int, str] = {}  # the root cause's stage, "abort" or "timeout", once there is one
    held_at: dict[int, float] = {}  # when a request was written to the end, none asking yet
    waits = 0

    def expect(k: int, i: int) -> None:
        if i in recvs[k]:
            return
        first = not recvs[k]
        recvs[k][i] = recv = pair.dec[i].expect(rids[k], [pair.pre.address], dst[k])
        if first and k in held_at and k not in fate and time.monotonic() - held_at[k] > STALL_S:
            # Asked late: whether the lease ran out first is the machine's timing. The first
            # asker's end says which; from then on the model holds every side to it.
            with contextlib.suppress(XferError):
                recv.wait(5)
            if recv.poll() is State.FAILED:
                fate[k] = "timeout"

    def settled(k: int) -> None:
        """Wait until an expired request's failure reached its handles: an abort now is late."""
        handles: list[Receive | Send] = [*recvs[k].values(), *([sends[k]] if k in sends else [])]
        for h in handles:
            with contextlib.suppress(XferError):
                h.wait(5)

    def step(op: str, k: int, i: int) -> None:
        nonlocal waits
        if op == "expect":
            for j in range(DECODE):
                expect(k, j)
        elif op == "expect_one":
            expect(k, i)
        elif op == "offer" and k not in sends:
            sends[k] = pair.pre.offer(rids[k])
        elif op == "write" and k in sends and written[k] < CHUNKS and k not in fate:
            c = written[k]
            chunk = {"kv": [src[k]["kv"][c]]} | ({"state": src[k]["state"]} if c == 0 else {})
            sends[k].write(chunk, last=c == CHUNKS - 1)
            written[k] += 1
            if written[k] == CHUNKS and not recvs[k]:
                held_at[k] = time.monotonic()
        elif op == "prefill":
            step("offer", k, i)
            while written[k] < CHUNKS and k not in fate:
                step("write", k, i)
        elif op == "abort_decode" and recvs[k] and fate.get(k) != "abort":
            if fate.get(k) == "timeout":
                settled(k)
            else:
                fate[k] = "abort"
            next(iter(recvs[k].values())).abort(5)
        elif op == "abort_prefill" and k in sends and fate.get(k) != "abort":
            if fate.get(k) == "timeout":
                settled(k)
            else:
                fate[k] = "abort"
            sends[k].abort(5)
        elif op == "wait_past_lease" and waits < WAITS:
            waits += 1
            # held: written to the end before any decode rank asked, and still unclaimed
            held = [j for j in sends if written[j] == CHUNKS and not recvs[j] and j not in fate]
            time.sleep(PAST_LEASE_S)
            for j in held:
                fate[j] = "timeout"
                settled(j)  # expired before the next op: a later expect comes after it
        elif op == "stall":  # the machine stops for a while, and the model is not told
            time.sleep(PAST_LEASE_S)

    for op, k, i in ops:
        step(op, k, i)
    for k in range(REQUESTS):  # the engine finishes what it started
        step("expect", k, 0)
        step("offer", k, 0)
        while written[k] < CHUNKS and k not in fate:
            step("write", k, 0)
    for k in range(REQUESTS):
        event(f"fate: {fate.get(k, 'none')}")  # --hypothesis-show-statistics
        handles = [*recvs[k].values(), sends[k]]
        for h in handles:
            with contextlib.suppress(XferError):
                h.wait(5)
            assert h.poll() in (State.DONE, State.FAILED), (k, h)
        failed = [h for h in handles if h.poll() is State.FAILED]
        texts = {str(h.error) for h in failed}
        assert len(texts) <= 1, texts  # one root cause
        if k not in fate:
            assert not failed, texts
        elif fate[k] == "abort":
            for h in failed:
                assert h.error is not None and h.error.stage == "abort", h.error
        else:  # expired: every side fails with the prefill's lease text, nothing was written
            assert failed == handles, (k, handles)
            assert all(h.error is not None and h.error.stage == "timeout" for h in handles)
            error = sends[k].error
            assert f"lease_s={LEASE_S}" in str(error) and texts == {str(error)}, texts
            for i in range(DECODE):
                for key, arr, rows in _slot_rows(pair.ref, i, dst[k]):
                    assert (arr[rows] == UNWRITTEN).all(), (k, i, key)
        for i, r in recvs[k].items():
            if r.poll() is State.DONE:
                want = pair.ref.expected(i, {p: (src[k][p], dst[k][p]) for p in dst[k]})
                for key, arr, rows in _slot_rows(pair.ref, i, dst[k]):
                    assert np.array_equal(arr[rows], want[key][rows]), (k, i, key)


def test_an_expect_racing_the_expiry_ends_all_done_or_all_timeout(pair: Pair) -> None:
    """Decode ranks asking about when the hold runs out: the prefill rank's I/O thread sees the
    first claim or the expiry first, and that decides for every side. Which one wins is timing;
    that every handle agrees, with one text and bytes to match, is not."""
    src = {"kv": [40, 41], "state": [9]}
    dst = {"kv": [61, 60], "state": [15]}
    for n, delay in enumerate(np.linspace(LEASE_S - 0.05, LEASE_S + 0.07, 7)):
        rid = f"race-{n}"
        for i in range(DECODE):
            for _, arr, rows in _slot_rows(pair.ref, i, dst):
                arr[rows] = UNWRITTEN
        send = pair.pre.offer(rid)
        send.write(src, last=True)
        time.sleep(delay)
        recvs = [d.expect(rid, [pair.pre.address], dst) for d in pair.dec]
        handles: list[Receive | Send] = [*recvs, send]
        for h in handles:
            with contextlib.suppress(XferError):
                h.wait(5)
        states = [h.poll() for h in handles]
        if states == [State.DONE] * len(handles):
            for i in range(DECODE):
                want = pair.ref.expected(i, {p: (src[p], dst[p]) for p in dst})
                for key, arr, rows in _slot_rows(pair.ref, i, dst):
                    assert np.array_equal(arr[rows], want[key][rows]), (rid, i, key)
            continue
        assert states == [State.FAILED] * len(handles), (rid, handles)
        assert all(h.error is not None and h.error.stage == "timeout" for h in handles)
        assert len({str(h.error) for h in handles}) == 1, [str(h.error) for h in handles]
        for i in range(DECODE):
            for key, arr, rows in _slot_rows(pair.ref, i, dst):
                assert (arr[rows] == UNWRITTEN).all(), (rid, i, key)


def test_an_abort_during_the_handshake_reaches_the_prefill_rank() -> None:
    """A decode rank aborting before its pair's handshake finished: the prefill rank, which
    has not heard of the request yet, must still learn it (stage abort, the decode rank's
    text), as it does when the handshake fails, instead of holding the written request
    until its lease runs out."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest, lease_s=LEASE_S)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest)
    try:
        recv = dec.expect("r", pre.address, {"kv": [1]})  # the first request of a new pair
        recv.abort(5)
        assert recv.error is not None and recv.error.stage == "abort", recv.error
        send = pre.offer("r")
        send.write({"kv": [2]}, last=True)
        with pytest.raises(RequestError) as info:
            send.wait(5)
        assert (info.value.stage, str(info.value)) == ("abort", str(recv.error))
    finally:
        pre.close()
        dec.close()
