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
from xferkit.session import Session, State
from xferkit.testing import Reference, RegionSpec, gdn_hybrid

SLOTS = {"kv": 16, "state": 4}


def _paged(spec: RegionSpec, src_pages: int, dst_pages: int) -> RegionSpec:
    """KV pages of ``src_pages`` and ``dst_pages`` model pages a slot (NHD on both sides)."""
    if spec.pool != "kv":
        return spec
    return msgspec.structs.replace(
        spec, axes=(xk.PAGE_AXIS, "head", "dim"), src_pages=src_pages, dst_pages=dst_pages
    )


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
    specs = [_paged(s, src_pages, dst_pages) for s in gdn_hybrid(2)]
    ref = Reference(specs, src_tp=2, dst_tp=4, src_slots=SLOTS, dst_slots=SLOTS, seed=7)
    pres = [Session(xk.open_backend("loopback"), r.manifest, staging=staging) for r in ref.srcs]
    decs = [Session(xk.open_backend("loopback"), d.manifest, staging=staging) for d in ref.dsts]
    try:
        request = {"kv": suffix_dst, "state": [1]}
        recvs = [d.expect("prefix", [p.address for p in pres], request) for d in decs]
        first = 2 // src_pages  # two model pages: a whole page on either side
        for p in pres:
            send = p.offer("prefix")
            send.write({"kv": suffix_src[:first]})
            send.write({"kv": suffix_src[first:], "state": [3]}, last=True)
        for h in recvs:
            assert h.wait(20) is State.DONE, h.error
        for i in range(len(decs)):
            ref.check(i, {"kv": (suffix_src, suffix_dst), "state": ([3], [1])})
    finally:
        for s in (*pres, *decs):
            s.close()
