"""Prefill TP 2 -> decode TP 4 and TP 4 -> TP 2 through Sessions, every rank in its own process.

Each topology runs direct (``staging="never"``) and with every region group staged through
small slices (several rounds per chunk, pack and unpack on the ranks' own CPUs).

Each rank builds the same reference model (GDN hybrid: GQA KV pages, conv and
temporal state, an empty short-conv state), so a decode rank checks every byte
it holds against the model without bytes crossing the test's pipes. Runs on the
loopback, on Mooncake (TCP on 127.0.0.1) and on NIXL (UCX, host memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from session_rank import (
    BACKENDS,
    Abort,
    Check,
    Expect,
    Offer,
    RankProcess,
    Setup,
    Wait,
    Write,
    start,
)

TOPOLOGIES = [(2, 4), (4, 2)]  # (prefill TP, decode TP)


class Cluster:
    def __init__(self, procs: list[RankProcess], src_tp: int) -> None:
        self.pre = procs[:src_tp]
        self.dec = procs[src_tp:]
        self.sources = [p.address for p in self.pre]
        self.written: dict[str, tuple[list[int], list[int]]] = {"kv": ([], []), "state": ([], [])}

    def record(self, src: dict[str, list[int]], dst: dict[str, list[int]]) -> None:
        for pool in src:
            self.written[pool][0].extend(src[pool])
            self.written[pool][1].extend(dst[pool])

    def check_bytes(self) -> None:
        for d in self.dec:
            d.ok(Check({p: v for p, v in self.written.items() if v[0]}))


STAGING: dict[str, dict[str, Any]] = {
    "never": {"staging": "never"},
    # Every region group through staging, with slices small enough that a chunk takes
    # several rounds and the chunks of a request queue for the decode rank's halves.
    "staged": {"staging": "always", "staging_bytes": 1 << 14, "staging_slice_bytes": 1 << 12},
}


@pytest.fixture(
    scope="module",
    params=[(b, t, s) for b in sorted(BACKENDS) for t in TOPOLOGIES for s in sorted(STAGING)],
    ids=lambda p: f"{p[0]}-tp{p[1][0]}to{p[1][1]}-{p[2]}",
)
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    name, (src_tp, dst_tp), staging = request.param
    options, session = BACKENDS[name], STAGING[staging]
    setups = [
        Setup("src", i, src_tp, dst_tp, name, options, session=session) for i in range(src_tp)
    ]
    setups += [
        Setup("dst", i, src_tp, dst_tp, name, options, session=session) for i in range(dst_tp)
    ]
    procs = start(setups)
    yield Cluster(procs, src_tp)
    for p in procs:
        p.close()


CHUNKS = [{"kv": [0, 1], "state": [3]}, {"kv": [2, 3]}, {"kv": [4, 5]}]


def _run(c: Cluster, rid: str, dst: dict[str, list[int]], decode_first: bool) -> None:
    def expect() -> None:
        for d in c.dec:
            d.ok(Expect(rid, c.sources, dst))

    if decode_first:
        expect()
    for p in c.pre:
        p.ok(Offer(rid))
    for i, chunk in enumerate(CHUNKS):
        for p in c.pre:
            p.ok(Write(rid, chunk, last=i == len(CHUNKS) - 1))
    if not decode_first:
        expect()
    for r in c.pre + c.dec:
        reply = r.ok(Wait(rid))
        assert reply.state == "DONE", reply.error
    src = {pool: [s for ch in CHUNKS for s in ch.get(pool, [])] for pool in dst}
    c.record(src, dst)
    c.check_bytes()


def test_decode_first_three_chunks_byte_exact(cluster: Cluster) -> None:
    _run(cluster, "decode-first", {"kv": [20, 3, 7, 8, 9, 30], "state": [5]}, True)


def test_prefill_first_three_chunks_byte_exact(cluster: Cluster) -> None:
    _run(cluster, "prefill-first", {"kv": [10, 11, 12, 13, 14, 15], "state": [1]}, False)


def test_abort_from_decode_fails_every_rank_with_one_root_cause(cluster: Cluster) -> None:
    rid = "aborted"
    for d in cluster.dec:
        d.ok(Expect(rid, cluster.sources, {"kv": [16, 17], "state": [6]}))
    for p in cluster.pre:
        p.ok(Offer(rid))
    first = cluster.dec[1].ok(Abort(rid))
    assert first.state == "FAILED" and first.stage == "abort"
    assert "decode rank 1" in first.error and "aborted by the engine" in first.error
    for r in cluster.pre + cluster.dec:
        reply = r.ok(Wait(rid, 5))
        assert (reply.state, reply.stage, reply.error) == ("FAILED", "abort", first.error)
    cluster.check_bytes()  # nothing landed in the aborted slots


def test_a_request_id_is_single_use(cluster: Cluster) -> None:
    rid = "decode-first"  # finished above (or now: the order of tests does not matter)
    cluster.dec[0].ask(Expect(rid, cluster.sources, {"kv": [31]}))
    again = cluster.dec[0].ask(Expect(rid, cluster.sources, {"kv": [31]}))
    assert not again.ok and "already used" in again.error
    cluster.pre[0].ask(Offer("dup-offer"))
    again = cluster.pre[0].ask(Offer("dup-offer"))
    assert not again.ok and "already used" in again.error
