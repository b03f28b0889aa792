"""A gated-delta-net hybrid under heterogeneous TP: every rank a process with its own Session.

Attention layers hold paged K and V (``pools.kv_pages``, heads sharded over TP); GDN layers
hold a conv state ``[layers, slots, kernel - 1, q | k | v]`` whose q, k and v blocks are
sharded separately (``Shard(1, groups=...)``) and a temporal state ``[layers, slots, heads,
dk, dv]`` sharded on heads (``pools.state_pool``). Each rank holds its shard of one seeded
model; prefill ranks send their Session addresses to this process over pipes, it hands the
list to every decode rank, and each decode rank checks every byte of its memory. Run:

    python examples/gdn_hybrid.py --tp 4:2    # or 2:4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch

import xferkit as xk
from xferkit import pools
from xferkit.pools import Shard

ATTENTION, GDN = [3, 7], [0, 1, 2, 4, 5, 6]  # layer ids of an 8-layer model
KV_HEADS, PAGE, HEAD_DIM, PAGES, SLOTS = 4, 4, 16, 8, 4
CONV, KERNEL, HEADS, DK, DV = (8, 8, 16), 4, 4, 8, 8  # conv groups: q, k, v channels
SRC, DST = {"kv": [0, 1, 2], "state": [1]}, {"kv": [5, 6, 7], "state": [3]}

Cache = dict[str, Any]  # "k", "v": a tensor per attention layer; "conv", "temporal": stacked


def shard(
    t: torch.Tensor, tp: int, r: int, axis: int, groups: tuple[int, ...] = ()
) -> torch.Tensor:
    """This rank's part of the whole tensor: each group along ``axis`` split ``tp`` ways."""
    blocks = t.split(list(groups), axis) if groups else [t]
    return torch.cat([b.chunk(tp, axis)[r] for b in blocks], axis).contiguous()


def cache(tp: int, rank: int) -> Cache:
    """Rank ``rank`` of ``tp``'s shard of the model's cache (the same seed on every rank)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    kv = [[rand(PAGES, PAGE, KV_HEADS, HEAD_DIM) for _ in ATTENTION] for _ in "kv"]
    conv = rand(len(GDN), SLOTS, KERNEL - 1, sum(CONV))
    temporal = rand(len(GDN), SLOTS, HEADS, DK, DV, dtype=torch.float32)
    return {
        "k": [shard(t, tp, rank, 2) for t in kv[0]],
        "v": [shard(t, tp, rank, 2) for t in kv[1]],
        "conv": shard(conv, tp, rank, 3, CONV),
        "temporal": shard(temporal, tp, rank, 2),
    }


def manifest(c: Cache, tp: int, rank: int) -> xk.Manifest:
    regions = [
        *pools.kv_pages("kv", k=c["k"], v=c["v"], layout="NHD", layers=ATTENTION),
        *pools.state_pool(
            "state",
            fields={"conv": c["conv"], "temporal": c["temporal"]},
            shards={"conv": Shard(1, groups=CONV), "temporal": Shard(0)},
            layers=GDN,
        ),
    ]
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp)


def tensors(c: Cache) -> list[tuple[str, torch.Tensor, int, str]]:
    """(label, tensor, its slot axis, pool) of every tensor of the cache."""
    kv = [
        (f"{n}[{layer}]", t, 0, "kv")
        for n in "kv"
        for layer, t in zip(ATTENTION, c[n], strict=True)
    ]
    return kv + [(n, c[n], 1, "state") for n in ("conv", "temporal")]


def mismatches(got: Cache, want: Cache) -> list[str]:
    """The decode tensors whose bytes are not zeros with the request's slots from prefill."""
    bad = []
    for (label, g, axis, pool), (_, w, _, _) in zip(tensors(got), tensors(want), strict=True):
        src, dst = torch.tensor(SRC[pool]), torch.tensor(DST[pool])
        expect = torch.zeros_like(g).index_copy_(axis, dst, w.index_select(axis, src))
        if not torch.equal(g.view(torch.uint8), expect.view(torch.uint8)):
            bad.append(label)
    return bad


def rank(role: str, tp: int, r: int, conn: Connection, keys: xk.SessionKeys) -> None:
    """One rank: a Session over its shard; prefill writes the request, decode checks it."""
    mine = cache(tp, r)
    if role == "decode":
        for _, t, _, _ in tensors(mine):
            t.zero_()
    session = xk.Session(xk.open_backend("loopback"), manifest(mine, tp, r), keys=keys)
    try:
        if role == "prefill":
            conn.send(session.address)
            send = session.offer("req-0")
            send.write(SRC, last=True)
            send.wait(timeout=30)
            conn.send(send.routes)
        else:
            recv = session.expect("req-0", source=conn.recv(), slots=DST)
            recv.wait(timeout=30)
            conn.send(mismatches(mine, cache(tp, r)))
        conn.recv()  # the parent says when to stop
    finally:
        session.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="4:2", help="prefill TP : decode TP (default 4:2)")
    src_tp, dst_tp = (int(n) for n in parser.parse_args().tp.split(":"))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "xferkit"])  # import once, not once per rank
    keys = xk.SessionKeys.generate()  # one CurveZMQ pair shared by every rank
    conns: dict[str, list[Connection]] = {"prefill": [], "decode": []}
    procs = []
    for role, tp in (("prefill", src_tp), ("decode", dst_tp)):
        for r in range(tp):
            here, there = ctx.Pipe()
            procs.append(ctx.Process(target=rank, args=(role, tp, r, there, keys), daemon=True))
            procs[-1].start()
            there.close()
            conns[role].append(here)
    addresses = [c.recv() for c in conns["prefill"]]
    for c in conns["decode"]:
        c.send(addresses)  # the prefill instance's ranks, as an engine publishes them
    for r, c in enumerate(conns["prefill"]):
        rt = c.recv()
        print(
            f"prefill rank {r}/{src_tp}: {rt.staged_bytes + rt.direct_bytes} B to decode, "
            f"{rt.staged} chunks staged, {rt.direct} direct"
        )
    bad = {r: c.recv() for r, c in enumerate(conns["decode"])}
    for c in conns["prefill"] + conns["decode"]:
        c.send("close")
    for p in procs:
        p.join(timeout=30)
    if any(bad.values()) or any(p.exitcode != 0 for p in procs):
        print(f"MISMATCH: {bad}, exit codes {[p.exitcode for p in procs]}")
        return 1
    print(f"TP {src_tp} -> {dst_tp}: every decode rank holds its KV and GDN state byte-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
