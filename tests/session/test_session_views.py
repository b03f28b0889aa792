"""Different layouts and page sizes on the two sides, through Sessions, every rank in its own
process: KV pages NHD of 8 tokens on prefill, HND of 16 tokens on decode (``session_rank``'s
``views``), so each decode slot takes two prefill slots and the heads are transposed.

Runs direct and staged (every group through small slices), on every driver; each decode rank
checks every byte it holds against the reference model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from session_rank import (
    BACKENDS,
    Check,
    Expect,
    Offer,
    Setup,
    Wait,
    Write,
    _views,
    start,
)
from test_session_e2e import STAGING, Cluster

import xferkit as xk
from xferkit.session import Session, State
from xferkit.testing import Reference, gdn_hybrid

RUNS = (((2, 4), "never"), ((4, 2), "staged"))  # (prefill TP, decode TP), staging


@pytest.fixture(
    scope="module",
    params=[(b, t, s) for b in sorted(BACKENDS) for t, s in RUNS],
    ids=lambda p: f"{p[0]}-tp{p[1][0]}to{p[1][1]}-{p[2]}",
)
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    name, (src_tp, dst_tp), staging = request.param
    options, session = BACKENDS[name], STAGING[staging]
    setups = [
        Setup("src", i, src_tp, dst_tp, name, options, session=session, views=True)
        for i in range(src_tp)
    ]
    setups += [
        Setup("dst", i, src_tp, dst_tp, name, options, session=session, views=True)
        for i in range(dst_tp)
    ]
    procs = start(setups)
    yield Cluster(procs, src_tp)
    for p in procs:
        p.close()


def test_two_prefill_pages_per_decode_page_transposed_byte_exact(cluster: Cluster) -> None:
    """Five prefill pages in two chunks fill three decode pages, the last one half (its second
    half keeps its bytes: the reference model checks every byte of every decode slot)."""
    rid = "views"
    dst = {"kv": [5, 9, 2], "state": [6]}
    for d in cluster.dec:
        d.ok(Expect(rid, cluster.sources, dst))
    for p in cluster.pre:
        p.ok(Offer(rid))
        p.ok(Write(rid, {"kv": [0, 1, 2, 3], "state": [3]}))
        p.ok(Write(rid, {"kv": [4]}, last=True))
    for r in cluster.pre + cluster.dec:
        reply = r.ok(Wait(rid))
        assert reply.state == "DONE", reply.error
    for d in cluster.dec:
        d.ok(Check({"kv": ([0, 1, 2, 3, 4], dst["kv"]), "state": ([3], dst["state"])}))


def test_a_chunk_ending_inside_a_decode_page_fails_naming_the_pool(cluster: Cluster) -> None:
    """A decode page holding two prefill pages is written by one chunk: a chunk of three that is
    not the last would leave the page's second half to a later one."""
    rid = "split-page"
    for d in cluster.dec:
        d.ok(Expect(rid, cluster.sources, {"kv": [20, 21]}))
    for p in cluster.pre:
        p.ok(Offer(rid))
    cluster.pre[0].ok(Write(rid, {"kv": [10, 11, 12]}))
    reply = cluster.pre[0].ok(Wait(rid))
    assert (reply.state, reply.stage) == ("FAILED", "plan"), reply
    assert "pool 'kv'" in reply.error and "multiple of 2" in reply.error
    for r in cluster.pre[1:] + cluster.dec:
        other = r.ok(Wait(rid))
        assert other.state == "FAILED" and "multiple of 2" in other.error, other


@pytest.mark.parametrize("views", [True, False], ids=["views", "alike"])
def test_a_pipeline_stage_without_a_pool_does_not_count_its_slots(views: bool) -> None:
    """Prefill split over two stages: the first holds only recurrent state, the second only KV
    pages (with views: NHD, half the decode's HND pages). The first never names ``kv`` slots
    and its plan pairs no ``kv`` region: its last chunk must not count the decode rank's ``kv``
    slots as left unwritten (it did, and failed every request through such a pipeline)."""
    specs = [_views(s) if views else s for s in gdn_hybrid(2)]
    slots = {"kv": 16, "state": 4}
    ref = Reference(specs, src_tp=1, dst_tp=1, src_pp=2, src_slots=slots, dst_slots=slots)
    stages = [Session(xk.open_backend("loopback"), r.manifest) for r in ref.srcs]
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        request = {"kv": [7, 2] if views else [7, 2, 5], "state": [1]}
        recv = dec.expect("pp", [s.address for s in stages], request)
        state, kv = (s.offer("pp") for s in stages)  # each stage names only what it holds
        state.write({"state": [2]}, last=True)
        kv.write({"kv": [3, 4]})
        kv.write({"kv": [9]}, last=True)
        assert recv.wait(10) is State.DONE, recv.error
        ref.check(0, {"kv": ([3, 4, 9], request["kv"]), "state": ([2], request["state"])})
    finally:
        for s in (*stages, dec):
            s.close()


@pytest.mark.parametrize("views", [True, False], ids=["views", "alike"])
def test_decode_pipeline_stages_each_get_their_layers(views: bool) -> None:
    """Decode split over two pipeline stages (the first holds only recurrent state, the second
    only KV pages), prefill in one: the prefill rank serves a Request from each stage, skips
    the pool a stage does not hold, and reports DONE only once both stages asked and were
    written. Before, the second stage's Request read as the first one's repeated."""
    specs = [_views(s) if views else s for s in gdn_hybrid(2)]
    slots = {"kv": 16, "state": 4}
    ref = Reference(specs, src_tp=1, dst_tp=1, dst_pp=2, src_slots=slots, dst_slots=slots)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    stages = [
        Session(xk.open_backend("loopback"), d.manifest, pp_rank=d.pp_stage, pp_size=2)
        for d in ref.dsts
    ]
    try:
        kv = [7, 2] if views else [7, 2, 5]
        send = pre.offer("dpp")
        send.write({"kv": [3, 4], "state": [2]})
        send.write({"kv": [9]}, last=True)
        first = stages[0].expect("dpp", [pre.address], {"state": [1]})
        assert first.wait(10) is State.DONE, first.error
        time.sleep(0.2)
        assert send.poll() is not State.DONE  # the second stage has not asked yet
        second = stages[1].expect("dpp", [pre.address], {"kv": kv})
        for h in (second, send):
            assert h.wait(10) is State.DONE, h.error
        ref.check(0, {"state": ([2], [1])})
        ref.check(1, {"kv": ([3, 4, 9], kv)})
    finally:
        for s in (pre, *stages):
            s.close()
