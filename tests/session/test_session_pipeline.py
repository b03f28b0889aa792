"""A thousand requests pipelined through one pair: none lost, none duplicated, none left over."""

from __future__ import annotations

import time

import xferkit as xk
from xferkit.session import Session, State
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 1024, "state": 16}
N = 1000


def test_a_thousand_pipelined_requests_all_complete_once() -> None:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        started = time.monotonic()
        recvs = [dec.expect(f"p{i}", [pre.address], {"kv": [i]}) for i in range(N)]
        sends = [pre.offer(f"p{i}") for i in range(N)]
        for i, s in enumerate(sends):
            s.write({"kv": [(i * 7) % 1024]}, last=True)
        for h in (*recvs, *sends):
            assert h.wait(30) is State.DONE
        took = time.monotonic() - started
        finished_dec, finished_pre = dec.progress(), pre.progress()
        assert sorted(finished_dec) == sorted(finished_pre) == sorted(f"p{i}" for i in range(N))
        assert dec.progress() == [] and pre.progress() == []
        ref.check(0, {"kv": ([(i * 7) % 1024 for i in range(N)], list(range(N)))})
        assert took < 20, f"{N} requests took {took:.1f} s"
        print(f"{N} pipelined requests in {took:.2f} s ({N / took:.0f}/s)")
    finally:
        pre.close()
        dec.close()
