"""A heterogeneous-TP handoff through NIXL across processes, byte-exact against the reference.

Prefill runs TP 4, decode TP 8, on a hybrid model: GQA attention layers with
8 KV heads (one layer HND, one NHD: head slices of a page, and per-token rows)
and GDN layers with a ``[q | k | v]`` conv state sharded group by group and a
temporal state of 4 heads, fewer than the decode ranks (so decode ranks hold
replicas), plus an empty short-conv entry the manifest drops.
"""

from __future__ import annotations

import time

import xferkit as xk
from xferkit.testing.conformance import drain_until, peer_setup, require_backend
from xferkit.testing.peer import Check, Drain, PeerProcess, Setup, Write
from xferkit.testing.reference import Reference, RegionSpec

require_backend("nixl")

SRC_TP, DST_TP = 4, 8
SRC_SLOTS, DST_SLOTS = {"kv": 24, "state": 6}, {"kv": 32, "state": 6}
REQUEST = {"kv": ([3, 4, 5, 9, 20], [0, 1, 2, 30, 7]), "state": ([2, 4], [5, 0])}


def specs() -> list[RegionSpec]:
    out: list[RegionSpec] = []
    for layer in (0, 2):  # GDN
        out += [
            RegionSpec(
                pool="state", name="conv", layer=layer, shape=(3, 48), tp_axis=1,
                tp_groups=(16, 16, 16),
            ),
            RegionSpec(
                pool="state", name="temporal", layer=layer, shape=(4, 8, 8), itemsize=4,
                tp_axis=0,
            ),
            RegionSpec(pool="state", name="sconv", layer=layer, shape=(0, 0), itemsize=4),
        ]  # fmt: skip
    for layer, (shape, axis) in ((1, ((8, 4, 8), 0)), (3, ((4, 8, 8), 1))):  # GQA: HND, NHD
        out += [
            RegionSpec(pool="kv", name=n, layer=layer, shape=shape, tp_axis=axis)
            for n in ("k", "v")
        ]
    return out


def _setup(role: str, index: int) -> Setup:
    return peer_setup("nixl", {}, role, index, SRC_TP, DST_TP, specs(), SRC_SLOTS, DST_SLOTS)


def _reference() -> Reference:
    return Reference(
        specs(), src_tp=SRC_TP, dst_tp=DST_TP, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
    )


def test_prefill_processes_write_into_decode_ranks_here() -> None:
    """Four prefill processes each write their shard into the eight decode ranks they feed."""
    ref = _reference()
    procs = [PeerProcess() for _ in range(SRC_TP)]  # they start in parallel
    dsts = [xk.open_backend("nixl") for _ in ref.dsts]
    try:
        for s, proc in enumerate(procs):
            ready = proc.ask(_setup("src", s))
            assert ready.ok, ready.error
        for backend, rank in zip(dsts, ref.dsts, strict=True):
            backend.register(rank.manifest)
        for i, (backend, rank) in enumerate(zip(dsts, ref.dsts, strict=True)):
            cov = xk.coverage([r.manifest for r in ref.srcs], rank.manifest)
            assert len(cov.sources) >= 1
            for s in cov.sources:
                reply = procs[s].ask(
                    Write(
                        endpoint=backend.endpoint(),
                        manifest=rank.manifest.encode(),
                        slots=REQUEST,
                        notify=f"req-1 from {s}".encode(),
                    )
                )
                assert reply.ok, reply.error
            ref.check(i, REQUEST)
            notes = drain_until(backend, len(cov.sources), 30)
            assert sorted(n.message for n in notes) == sorted(
                f"req-1 from {s}".encode() for s in cov.sources
            )
            assert len({n.peer for n in notes}) == len(cov.sources)  # one agent per source
    finally:
        for proc in procs:
            proc.close()
        for backend in dsts:
            backend.close()


def test_prefill_ranks_here_write_into_decode_processes() -> None:
    """The four prefill ranks live here; decode ranks 3 and 6 live in their own processes."""
    ref = _reference()
    chosen = (3, 6)
    procs = {i: PeerProcess() for i in chosen}
    srcs = [xk.open_backend("nixl") for _ in ref.srcs]
    try:
        for backend, rank in zip(srcs, ref.srcs, strict=True):
            backend.register(rank.manifest)
        for i, proc in procs.items():
            ready = proc.ask(_setup("dst", i))
            assert ready.ok, ready.error
            dst_manifest = xk.Manifest.decode(ready.manifest)
            cov = xk.coverage([r.manifest for r in ref.srcs], dst_manifest)
            transfers = []
            for s in cov.sources:  # all sources write at once
                peer = srcs[s].connect(ready.endpoint, dst_manifest)
                transfers.append(srcs[s].write(peer, cov.plans[s].expand(REQUEST), b"sent"))
            for t in transfers:
                t.wait(30)
            result = proc.ask(Check(slots=REQUEST))
            assert result.ok, result.error
            notes: list = []
            deadline = time.monotonic() + 30
            while len(notes) < len(cov.sources) and time.monotonic() < deadline:
                notes += proc.ask(Drain()).notes
            want = [(f"nixl:{srcs[s].driver.address}", b"sent") for s in cov.sources]
            assert sorted(notes) == sorted(want)  # the sender as its peers name it
    finally:
        for proc in procs.values():
            proc.close()
        for backend in srcs:
            backend.close()
