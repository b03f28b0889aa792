"""Prefix delta: a decode rank that already holds a prompt's prefix (a radix or prefix cache)
receives only the rest, with the slot maps as they are.

The decode rank offers only the suffix's pages in ``expect``; the prefill rank writes only the
suffix's pages. Pages pair in order from the first one named on each side, so the delta must
start where a page starts on *both* sides: with pages of different sizes, at a boundary of the
larger page (a prefix cache that keeps whole decode pages gives that when the decode's pages
are the larger ones). Recurrent state is the state at the prompt's end: it is always sent
whole. The reference model checks every byte of every decode slot: the suffix's against the
prefill's, the prefix's against what they held before (the decode's cache).
"""

from __future__ import annotations

import msgspec
import pytest

import xferkit as xk
from xferkit.session import RequestError, Session, State
from xferkit.testing import Reference, RegionSpec, gdn_hybrid

SLOTS = {"kv": 16, "state": 4}


def _paged(spec: RegionSpec, src_pages: int, dst_pages: int) -> RegionSpec:
    """KV pages of ``src_pages`` and ``dst_pages`` model pages a slot (NHD on both sides)."""
    if spec.pool != "kv":
        return spec
    return msgspec.structs.replace(
        spec, axes=(xk.PAGE_AXIS, "head", "dim"), src_pages=src_pages, dst_pages=dst_pages
    )


def _move(
    pages: tuple[int, int],
    chunks: list[list[int]],
    suffix: tuple[list[int], list[int]],
    staging: str,
    skip: int = 0,
) -> None:
    """TP 2 -> 4 with ``pages`` (source, destination) model pages a KV slot: the decode ranks
    expect ``suffix[1]`` (and a state slot), the prefill ranks write ``chunks`` (the state with
    the last); every byte of every decode slot must then match the model with the suffix's
    source slots ``suffix[0]`` moved, and nothing else."""
    specs = [_paged(s, *pages) for s in gdn_hybrid(2)]
    ref = Reference(specs, src_tp=2, dst_tp=4, src_slots=SLOTS, dst_slots=SLOTS, seed=7)
    pres = [Session(xk.open_backend("loopback"), r.manifest, staging=staging) for r in ref.srcs]
    decs = [Session(xk.open_backend("loopback"), d.manifest, staging=staging) for d in ref.dsts]
    try:
        request = {"kv": suffix[1], "state": [1]}
        held = {"kv": skip} if skip else None
        recvs = [d.expect("p", [p.address for p in pres], request, skip=held) for d in decs]
        for p in pres:
            send = p.offer("p")
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                send.write({"kv": chunk, **({"state": [3]} if last else {})}, last=last)
        for h in recvs:
            assert h.wait(20) is State.DONE, h.error
        for i in range(len(decs)):
            ref.check(i, {"kv": (suffix[0], suffix[1]), "state": ([3], [1])})
    finally:
        for s in (*pres, *decs):
            s.close()


@pytest.mark.parametrize(
    ("src_pages", "dst_pages", "suffix_src", "suffix_dst"),
    [
        (1, 1, [4, 5, 6, 7, 9, 10], [2, 5, 6, 13, 14, 15]),  # pages alike: any page boundary
        (1, 2, [4, 5, 6, 7, 9, 10], [2, 5, 6]),  # a decode page holds two prefill pages
        (2, 1, [4, 5, 6], [2, 5, 6, 13, 14, 15]),  # a prefill page holds two decode pages
    ],
    ids=["alike", "decode-pages-larger", "prefill-pages-larger"],
)
@pytest.mark.parametrize("staging", ["never", "always"])
def test_only_the_suffix_moves_and_the_cached_prefix_keeps_its_bytes(
    src_pages: int, dst_pages: int, suffix_src: list[int], suffix_dst: list[int], staging: str
) -> None:
    """TP 2 -> 4. The prefix (on the prefill side its slots 0-3, on the decode side slots the
    request never names) is what the decode's cache holds: the reference model's check covers
    every byte of every decode slot, so a prefix slot written, or a suffix page shifted by the
    prefix, fails it."""
    first = 2 // src_pages  # two model pages: a whole page on either side
    chunks = [suffix_src[:first], suffix_src[first:]]
    _move((src_pages, dst_pages), chunks, (suffix_src, suffix_dst), staging)


# -- skip: the decode says what it holds, the prefill writes every page ---------------------

# (source pages, destination pages per slot, destination slots held, the prefill's chunks)
SKIPS = [
    (1, 1, 3, [[0, 1], [2, 3, 4], [5, 6, 7]]),  # the second chunk is half prefix
    (1, 2, 2, [[0, 1, 2, 3], [4, 5], [6, 7, 9]]),  # 2 decode slots held: 4 prefill slots
    (2, 1, 4, [[0], [1, 2], [3, 4]]),  # 4 decode slots held: 2 prefill slots
]


@pytest.mark.parametrize(
    ("src_pages", "dst_pages", "held", "chunks"),
    SKIPS,
    ids=["alike", "decode-pages-larger", "prefill-pages-larger"],
)
@pytest.mark.parametrize("staging", ["never", "always"])
def test_a_prefill_writing_every_page_sends_only_what_the_decode_does_not_hold(
    src_pages: int, dst_pages: int, held: int, chunks: list[list[int]], staging: str
) -> None:
    """As vLLM's push and sglang's sender do, the prefill writes the whole prompt; the decode
    rank's ``expect(skip=)`` says how many of the request's first destination slots it holds,
    and names only the rest: each source drops the source slots that would fill the held
    ones (chunks straddling the boundary included), and every decode byte is checked: the
    held slots keep their bytes, the rest hold the prompt's pages after the prefix. Without
    the skip, the suffix would be the prompt's first pages."""
    every = [s for c in chunks for s in c]
    suffix_src = every[held * dst_pages // src_pages :]
    suffix_dst = [2, 5, 6, 13, 14, 15, 0, 1][: -(-len(suffix_src) * src_pages // dst_pages)]
    _move((src_pages, dst_pages), chunks, (suffix_src, suffix_dst), staging, skip=held)


def test_a_skip_ending_inside_a_source_slot_fails_both_sides_naming_the_pool() -> None:
    """A prefill slot holds two decode slots: holding 3 decode slots would start the suffix
    halfway through a prefill slot, which the slot maps cannot say; the request fails at plan
    on both sides rather than land shifted."""
    specs = [_paged(s, 2, 1) for s in gdn_hybrid(2)]
    ref = Reference(specs, src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS, seed=3)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        recv = dec.expect("odd", [pre.address], {"kv": [4, 5, 6]}, skip={"kv": 3})
        send = pre.offer("odd")
        send.write({"kv": [0, 1, 2]}, last=True)
        for h in (recv, send):
            with pytest.raises(RequestError, match=r"pool 'kv'.*inside a source slot") as info:
                h.wait(10)
            assert info.value.stage == "plan"
        ref.check(0, {})  # nothing landed
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize(
    ("skip", "message"),
    [
        ([("kv", 1)], "skip maps pool"),
        ({"state": 1}, "which slots does not name"),
        ({"kv": -1}, "is a slot count"),
        ({"kv": True}, "is a slot count"),
        ({"kv": 1.0}, "is a slot count"),
        ({"kv": 1 << 40}, "is a slot count"),
    ],
)
def test_a_wrong_skip_is_refused_naming_it(skip: object, message: str) -> None:
    ref = Reference(gdn_hybrid(2), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        with pytest.raises(xk.ArgumentError, match=message):
            dec.expect("bad", ["tcp://127.0.0.1:1"], {"kv": [1]}, skip=skip)  # type: ignore[arg-type]
        dec.expect("bad", ["tcp://127.0.0.1:1"], {"kv": [1]}).abort(0)  # the id was not taken
    finally:
        dec.close()
