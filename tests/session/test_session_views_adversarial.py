"""A buggy or hostile prefill rank against a decode rank whose pages differ from its own: forged
staged rounds must fail the request at once, never unpack twice into a slot, and never make
the decode rank hold more than the request's slots' worth of unpack state."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

import xferkit as xk
from xferkit.session import RequestError, Session, State, wire
from xferkit.testing import Reference, RegionSpec

HEADS, DIM, PAGE = 4, 8, 4


def _specs() -> list[RegionSpec]:
    """KV ``[token, head, dim]`` on prefill, ``[head, token, dim]`` of two prefill pages on
    decode: a decode slot holds two prefill slots, transposed."""
    return [
        RegionSpec(
            pool="kv",
            name=n,
            layer=0,
            shape=(PAGE, HEADS, DIM),
            itemsize=2,
            tp_axis=1,
            axes=(xk.PAGE_AXIS, "head", "dim"),
            dst_order=(1, 0, 2),
            dst_pages=2,
        )
        for n in "kv"
    ]


class Pair:
    """One prefill and one decode Session on the loopback, every group staged on both sides."""

    def __init__(self) -> None:
        self.ref = Reference(_specs(), src_tp=1, dst_tp=1, src_slots={"kv": 8}, dst_slots={"kv": 4})
        options = dict(
            staging="always",
            staging_bytes=1 << 14,
            staging_slice_bytes=1 << 12,
            request_timeout_s=3.0,
        )
        self.pre = Session(xk.open_backend("loopback"), self.ref.srcs[0].manifest, **options)  # type: ignore[arg-type]
        self.dec = Session(xk.open_backend("loopback"), self.ref.dsts[0].manifest, **options)  # type: ignore[arg-type]

    def forge(self, rid: str, rounds: list[wire.Round]) -> RequestError:
        """The prefill's backend sends completion tags naming staged rounds it never wrote;
        returns the decode rank's root cause."""
        recv = self.dec.expect(rid, [self.pre.address], {"kv": [0, 1, 2, 3]})
        deadline = time.monotonic() + 10
        while recv.poll() is not State.WAITING and time.monotonic() < deadline:
            time.sleep(0.01)
        rec = self.dec._protocol.incoming.recvs[rid]
        assert all(s.slice for s in rec.needed.values()), "the decode rank must unpack"
        peer = next(iter(self.pre._protocol.pairs.downs.values())).peer
        assert peer is not None
        for r in rounds:
            tag = wire.Tag(rid, rec.gen, 0, 0, 0, r)
            self.pre.backend.write(peer, xk.Descriptors.empty(), wire.encode(tag)).wait(5)
        with pytest.raises(RequestError) as info:
            recv.wait(10)
        return info.value

    def close(self) -> None:
        self.pre.close()
        self.dec.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_staged_round_naming_slots_another_chunk_named_fails_at_once(pair: Pair) -> None:
    """A prefill rank writes each decode slot in one chunk (its cursor only moves on). Two
    chunks naming the same slots are forged: the second must fail the request (stage
    "transfer", naming the prefill rank) rather than unpack into those slots again and leave
    the request to its timeout. Unbounded, a peer could make the decode rank hold one chunk's
    rounds (and its direct descriptors) per slot, each over every slot: quadratic memory."""
    at = {"kv": (0, 4, 8)}  # the whole request, twice
    rounds = [wire.Round(chunk=c, index=0, at=at) for c in range(2)]
    err = pair.forge("overlap", rounds)
    assert err.stage == "transfer", err
    assert "prefill rank 0" in str(err)


def test_a_staged_round_with_more_sources_than_its_slots_hold_fails(pair: Pair) -> None:
    """Two decode slots hold four prefill slots: a round claiming five (or none) is refused
    before anything is unpacked, and the request fails rather than waiting."""
    for n, sources in enumerate((5, 0, 2**31)):
        err = pair.forge(f"sources{n}", [wire.Round(chunk=0, index=0, at={"kv": (0, 2, sources)})])
        assert err.stage == "transfer" and "nothing of it was unpacked" in str(err), err


def test_views_pair_still_moves_exact_bytes_after_forged_rounds(pair: Pair) -> None:
    """After a forged round failed one request, the pair serves the next byte-exact."""
    pair.forge("forged", [wire.Round(chunk=0, index=0, at={"kv": (1, 9, 9)})])
    recv = pair.dec.expect("real", [pair.pre.address], {"kv": [3, 0]})
    send = pair.pre.offer("real")
    send.write({"kv": [5, 6]})
    send.write({"kv": [1]}, last=True)
    assert recv.wait(10) is State.DONE and send.wait(10) is State.DONE
    pair.ref.check(0, {"kv": ([5, 6, 1], [3, 0])})


def test_an_over_long_root_cause_still_reaches_the_peer() -> None:
    """A plan error quoting a peer's long axis names ran past what a control message may carry
    (16 KiB of text): the decode rank dropped the Welcome as malformed and its request waited
    for a timeout. The text is now clipped, the same on both sides."""
    long = "h" * 20_000
    spec = _specs()[0]
    ref = Reference(
        [msgspec.structs.replace(spec, axes=(xk.PAGE_AXIS, long, "dim"))],
        src_tp=1,
        dst_tp=1,
        src_slots={"kv": 8},
        dst_slots={"kv": 4},
    )
    other = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 8}, dst_slots={"kv": 4})
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest, request_timeout_s=30.0)
    dec = Session(xk.open_backend("loopback"), other.dsts[0].manifest, request_timeout_s=30.0)
    try:
        recv = dec.expect("long", [pre.address], {"kv": [0]})
        send = pre.offer("long")
        for h in (recv, send):
            with pytest.raises(RequestError) as info:
                h.wait(10)
            assert info.value.stage == "plan"
        assert str(recv.error) == str(send.error)
        assert len(str(recv.error)) <= wire.MAX_TEXT and "characters in all)" in str(recv.error)
    finally:
        pre.close()
        dec.close()
