"""``Request.skip`` from a raw peer: a hostile decode rank sends any skip it likes.

The attacker (``attacker.py``) says Hello to a real prefill Session and claims a request with
a hand-built ``wire.Request`` whose ``skip`` an honest ``expect(skip=)`` would never send:
past the request, at the wire's maximum, on a pool the source lacks. The prefill must write
only into the slots that connection named (its own memory), fail what it cannot honour
naming the pool, and keep serving honest decode ranks byte-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from attacker import Attacker
from session_rank import reference

import xferkit as xk
from xferkit.session import RequestError, Session, State
from xferkit.testing import Reference, gdn_hybrid

FAST: dict[str, Any] = {"heartbeat_s": 0.2, "dead_after_s": 2.0, "handshake_timeout_s": 3.0}


@contextmanager
def prefill_and_attacker() -> Iterator[tuple[Session, Attacker, Reference]]:
    """A prefill Session over a reference's source rank, and an attacker posing as its
    decode rank over that reference's destination memory (so ``ref.check`` reads it)."""
    ref = reference(1, 1, seed=5)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest, **FAST)
    try:
        with Attacker(ref.dsts[0].manifest, memory=ref) as a:
            yield pre, a, ref
    finally:
        pre.close()


def _honest_after(pre: Session, rid: str) -> None:
    """An honest decode rank's request on the same prefill: DONE, byte-exact."""
    ref = reference(1, 1, seed=5)  # the same seed: the same source bytes as the prefill's
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest, **FAST)
    try:
        recv = dec.expect(rid, pre.address, {"kv": [6, 7]}, skip={"kv": 1})
        send = pre.offer(rid)
        send.write({"kv": [8, 9, 10]}, last=True)
        assert recv.wait(10) is State.DONE
        assert send.wait(10) is State.DONE
        ref.check(0, {"kv": ([9, 10], [6, 7])})
    finally:
        dec.close()


@pytest.mark.parametrize(
    ("skip", "lands"),
    [
        ({"kv": 2}, ([2, 3], [4, 5])),  # as expect(skip=) sends it: the suffix lands
        ({"nopool": 5}, ([0, 1], [4, 5])),  # a pool no region of the pair holds: no effect
        ({"kv": 0}, ([0, 1], [4, 5])),  # nothing held
    ],
    ids=["suffix", "unknown-pool", "zero"],
)
def test_a_raw_skip_acts_like_expects_and_lands_only_in_the_named_slots(
    skip: dict[str, int], lands: tuple[list[int], list[int]]
) -> None:
    with prefill_and_attacker() as (pre, a, ref):
        conn = a.connect(pre.address)
        welcome = conn.hello()
        assert welcome is not None and not welcome.error, welcome
        conn.request("h", {"kv": [4, 5]}, skip=skip)
        assert conn.sync()
        send = pre.offer("h")
        send.write({"kv": [0, 1, 2, 3][: 2 + skip.get("kv", 0)]}, last=True)
        assert send.wait(10) is State.DONE
        ref.check(0, {"kv": lands})  # every other byte of the attacker's memory as it was
        _honest_after(pre, "after")


@pytest.mark.parametrize("held", [3, 2**31], ids=["past-the-request", "wire-maximum"])
def test_a_skip_past_what_the_source_writes_fails_naming_the_pool_and_writes_nothing(
    held: int,
) -> None:
    """The decode claims to hold more than the prefill writes: the named slots would be left
    unwritten, so the request fails at plan naming the pool (not DONE with stale slots), no
    byte lands, and the prefill serves the next request."""
    with prefill_and_attacker() as (pre, a, ref):
        conn = a.connect(pre.address)
        welcome = conn.hello()
        assert welcome is not None and not welcome.error, welcome
        conn.request("h", {"kv": [4, 5]}, skip={"kv": held})
        assert conn.sync()
        send = pre.offer("h")
        send.write({"kv": [0]})
        send.write({"kv": [1, 2]}, last=True)
        with pytest.raises(RequestError, match=r"pool 'kv'.*unwritten") as info:
            send.wait(10)
        assert info.value.stage == "plan"
        ref.check(0, {})  # nothing landed anywhere in the attacker's memory
        _honest_after(pre, "after")


# -- skip with pipeline stages that hold no region of the skipped pool ------------------------


def test_a_skip_reaches_prefill_stages_without_the_pool_and_only_the_kv_stage_drops() -> None:
    """Prefill in two pipeline stages (the first holds only recurrent state, the second only
    KV pages): the decode's ``skip={"kv": 1}`` goes to both; the state stage holds no region
    of ``kv``, so it neither drops nor waits for kv pages, and the KV stage drops its first
    page, whatever each was asked to write."""
    slots = {"kv": 16, "state": 4}
    ref = Reference(gdn_hybrid(2), src_tp=1, dst_tp=1, src_pp=2, src_slots=slots, dst_slots=slots)
    stages = [Session(xk.open_backend("loopback"), r.manifest, **FAST) for r in ref.srcs]
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest, **FAST)
    try:
        request = {"kv": [7, 2], "state": [1]}
        recv = dec.expect("pp", [s.address for s in stages], request, skip={"kv": 1})
        state, kv = (s.offer("pp") for s in stages)
        state.write({"state": [2]}, last=True)
        kv.write({"kv": [3, 4]})
        kv.write({"kv": [9]}, last=True)
        for h in (recv, state, kv):
            assert h.wait(10) is State.DONE, h.error
        ref.check(0, {"kv": ([4, 9], [7, 2]), "state": ([2], [1])})
    finally:
        for s in (*stages, dec):
            s.close()


def test_a_decode_stage_holding_the_pool_skips_and_the_other_stage_is_served_whole() -> None:
    """Decode in two pipeline stages (state, then KV): only the KV stage names a skip; the
    prefill writes the whole prompt once, the state stage gets its state, the KV stage the
    prompt's pages after the first."""
    slots = {"kv": 16, "state": 4}
    ref = Reference(gdn_hybrid(2), src_tp=1, dst_tp=1, dst_pp=2, src_slots=slots, dst_slots=slots)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest, **FAST)
    stages = [
        Session(xk.open_backend("loopback"), d.manifest, pp_rank=d.pp_stage, pp_size=2, **FAST)
        for d in ref.dsts
    ]
    try:
        with pytest.raises(xk.ArgumentError, match="which slots does not name"):
            stages[0].expect("dpp", [pre.address], {"state": [1]}, skip={"kv": 1})
        first = stages[0].expect("dpp2", [pre.address], {"state": [1]})
        second = stages[1].expect("dpp2", [pre.address], {"kv": [7, 2]}, skip={"kv": 1})
        send = pre.offer("dpp2")
        send.write({"kv": [3, 4], "state": [2]})
        send.write({"kv": [9]}, last=True)
        for h in (first, second, send):
            assert h.wait(10) is State.DONE, h.error
        ref.check(0, {"state": ([2], [1])})
        ref.check(1, {"kv": ([4, 9], [7, 2])})
    finally:
        for s in (pre, *stages):
            s.close()


def test_a_decode_holding_the_whole_prompt_ends_done_with_nothing_written() -> None:
    """``skip`` covering every page the prefill writes, with no destination slot named: both
    sides end DONE and the decode's memory is untouched (the state still moves)."""
    ref = reference(1, 1, seed=5)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest, **FAST)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest, **FAST)
    try:
        recv = dec.expect("all", pre.address, {"kv": [], "state": [1]}, skip={"kv": 3})
        send = pre.offer("all")
        send.write({"kv": [0, 1]})
        send.write({"kv": [2], "state": [2]}, last=True)
        for h in (recv, send):
            assert h.wait(10) is State.DONE, h.error
        ref.check(0, {"state": ([2], [1])})
    finally:
        pre.close()
        dec.close()
