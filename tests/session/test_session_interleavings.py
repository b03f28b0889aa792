"""Random interleavings of expect / offer / write chunks / abort across a few requests.

Both sides run in one process over MockDriver (real copies, real sockets): each
request ends DONE or FAILED, FAILED only when it was aborted (with the abort's
text on both sides when both failed), and every DONE request's bytes are exact.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit import Backend, XferError
from xferkit.session import Receive, Send, Session, State
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver

SLOTS = {"kv": 64, "state": 16}
REQUESTS = 3
CHUNKS = 3
_ids = itertools.count()


class Pair:
    def __init__(self) -> None:
        self.ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=2, src_slots=SLOTS, dst_slots=SLOTS)
        self.pre = Session(Backend(MockDriver()), self.ref.srcs[0].manifest)
        self.dec = [Session(Backend(MockDriver()), d.manifest) for d in self.ref.dsts]

    def close(self) -> None:
        for s in (self.pre, *self.dec):
            s.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["expect", "offer", "write", "abort_decode", "abort_prefill"]),
        st.integers(0, REQUESTS - 1),
    ),
    max_size=20,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_random_interleavings_end_in_the_right_states(
    pair: Pair, ops: list[tuple[str, int]]
) -> None:
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
    recvs: dict[int, list[Receive]] = {}
    sends: dict[int, Send] = {}
    written = dict.fromkeys(range(REQUESTS), 0)
    aborted: set[int] = set()

    def step(op: str, k: int) -> None:
        if op == "expect" and k not in recvs:
            recvs[k] = [d.expect(rids[k], [pair.pre.address], dst[k]) for d in pair.dec]
        elif op == "offer" and k not in sends:
            sends[k] = pair.pre.offer(rids[k])
        elif op == "write" and k in sends and written[k] < CHUNKS and k not in aborted:
            c = written[k]
            chunk = {"kv": [src[k]["kv"][c]]} | ({"state": src[k]["state"]} if c == 0 else {})
            sends[k].write(chunk, last=c == CHUNKS - 1)
            written[k] += 1
        elif op == "abort_decode" and k in recvs and k not in aborted:
            aborted.add(k)
            recvs[k][0].abort(5)
        elif op == "abort_prefill" and k in sends and k not in aborted:
            aborted.add(k)
            sends[k].abort(5)

    for op, k in ops:
        step(op, k)
    for k in range(REQUESTS):  # the engine finishes what it started
        step("expect", k)
        step("offer", k)
        while written[k] < CHUNKS and k not in aborted:
            step("write", k)
    for k in range(REQUESTS):
        handles = [*recvs[k], sends[k]]
        for h in handles:
            with contextlib.suppress(XferError):
                h.wait(5)
            assert h.poll() in (State.DONE, State.FAILED), (k, h)
        failed = [h for h in handles if h.poll() is State.FAILED]
        if k not in aborted:
            assert not failed, [str(h.error) for h in failed]
        for h in failed:
            assert h.error is not None and h.error.stage == "abort", h.error
        assert len({str(h.error) for h in failed}) <= 1  # one root cause
        for i, r in enumerate(recvs[k]):
            if r.poll() is State.DONE:
                want = pair.ref.expected(i, {p: (src[k][p], dst[k][p]) for p in dst[k]})
                for key, arr in pair.ref.dsts[i].arrays.items():
                    rows = np.asarray(dst[k][key[0]])
                    assert np.array_equal(arr[rows], want[key][rows]), (k, i, key)
