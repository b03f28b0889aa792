"""A short-conv hybrid's recurrent state, prefill process -> decode process, through Sessions.

The model has 42 layers with a short convolution each: four conv streams (one tensor
``[layers, slots, channels, window]`` per stream) and a temporal state the engine allocates
empty, ``[layers, slots, 0, 0, 0]``. ``pools.state_pool`` describes both as they are, and
``Manifest.build`` drops the empty temporal regions, listing them in ``Manifest.dropped``:
nothing moves for them. This process is the prefill rank; it spawns the decode rank, sends
it its Session address over a pipe, and the decode rank checks every byte it received.
Attention layers would add their KV pages with ``pools.kv_pages`` (see gqa_dense.py). Run:

    python examples/short_conv_hybrid.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from multiprocessing.connection import Connection

import torch

import xferkit as xk
from xferkit import pools
from xferkit.pools import Shard

LAYERS, STREAMS, SLOTS, CHANNELS, WINDOW = 42, 4, 4, 16, 3
SRC_SLOT, DST_SLOT = 1, 3  # the request's state slot on each side


def state(prefill: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The engine's buffers: four conv streams (random on prefill, zeros on decode) and the
    empty temporal state."""
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, SLOTS, CHANNELS, WINDOW)
    conv = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(STREAMS)]
    if not prefill:
        conv = [torch.zeros_like(c) for c in conv]
    return conv, torch.empty(LAYERS, SLOTS, 0, 0, 0, dtype=torch.bfloat16)


def manifest(conv: list[torch.Tensor], temporal: torch.Tensor) -> xk.Manifest:
    fields = {"conv": conv, "temporal": temporal}
    shards = {"conv": Shard(0), "temporal": Shard(0)}  # channels (and heads) over TP
    return xk.Manifest.build(pools.state_pool("state", fields=fields, shards=shards))


def decode(conn: Connection, keys: xk.SessionKeys) -> None:
    """The decode process: expect the request, wait for it, check every byte."""
    conv, temporal = state(prefill=False)
    want, _ = state(prefill=True)  # what the prefill holds: same seed
    session = xk.Session(xk.open_backend("loopback"), manifest(conv, temporal), keys=keys)
    try:
        recv = session.expect("req-0", source=conn.recv(), slots={"state": [DST_SLOT]})
        recv.wait(timeout=30)
        bad = []
        for i, (got, src) in enumerate(zip(conv, want, strict=True)):
            expect = torch.zeros_like(got)  # the other slots stay as they were
            expect[:, DST_SLOT] = src[:, SRC_SLOT]
            if not torch.equal(got.view(torch.uint8), expect.view(torch.uint8)):
                bad.append(i)
        conn.send(bad)
        conn.recv()  # the prefill says when to stop
    finally:
        session.close()


def main() -> int:
    conv, temporal = state(prefill=True)
    m = manifest(conv, temporal)
    names = [xk.key_label(d.key) for d in m.dropped]
    print(f"dropped {len(names)} regions: {names[0]}, {names[1]}, ..., {names[-1]}")
    print(f"  why: {m.dropped[0].reason}; kept {len(m)} conv regions")
    keys = xk.SessionKeys.generate()  # one CurveZMQ pair shared by both ranks
    here, there = mp.Pipe()
    child = mp.get_context("spawn").Process(target=decode, args=(there, keys), daemon=True)
    child.start()
    there.close()
    session = xk.Session(xk.open_backend("loopback"), m, keys=keys)
    try:
        here.send(session.address)
        send = session.offer("req-0")
        send.write({"state": [SRC_SLOT]}, last=True)
        send.wait(timeout=30)
        moved = send.routes.direct_bytes + send.routes.staged_bytes
        print(f"prefill slot {SRC_SLOT} -> decode slot {DST_SLOT}: {moved} B")
        bad = here.recv()
        here.send("close")
    finally:
        session.close()
    child.join(timeout=30)
    if bad or child.exitcode != 0:
        print(f"MISMATCH in conv streams {bad} (decode exit code {child.exitcode})")
        return 1
    print(f"decode holds all {STREAMS} conv streams of {LAYERS} layers byte-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
