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

import pytest
from attacker import Attacker
from session_rank import reference

import xferkit as xk
from xferkit.session import RequestError, Session, State
from xferkit.testing import Reference

FAST = {"heartbeat_s": 0.2, "dead_after_s": 2.0, "handshake_timeout_s": 3.0}


@contextmanager
def prefill_and_attacker() -> Iterator[tuple[Session, Attacker, Reference]]:
    """A prefill Session over a reference's source rank, and an attacker posing as its
    decode rank over that reference's destination memory (so ``ref.check`` reads it)."""
    ref = reference(1, 1, seed=5)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest, **FAST)  # type: ignore[arg-type]
    try:
        with Attacker(ref.dsts[0].manifest, memory=ref) as a:
            yield pre, a, ref
    finally:
        pre.close()


def _honest_after(pre: Session, rid: str) -> None:
    """An honest decode rank's request on the same prefill: DONE, byte-exact."""
    ref = reference(1, 1, seed=5)  # the same seed: the same source bytes as the prefill's
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest, **FAST)  # type: ignore[arg-type]
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
