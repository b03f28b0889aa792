"""A GQA dense model's paged KV cache, prefill TP 8 -> decode TP 4, over a real driver.

Twelve ranks in one process (an engine runs one per rank process, as gdn_hybrid.py does),
each a Session over a backend of its own: the loopback, Mooncake (tcp on 127.0.0.1) or
NIXL. ``pools.kv_pages`` describes each rank's K and V pages with their layout: prefill
holds NHD pages (``[pages, token, head, dim]``), decode HND (``[pages, head, token,
dim]``), and the named axes let them pair. Each decode rank holds two of the eight KV
heads, from two prefill ranks, and checks every byte. Run:

    python examples/gqa_dense.py --driver loopback|mooncake|nixl
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import xferkit as xk
from xferkit import pools

LAYERS, KV_HEADS, PAGE, HEAD_DIM, PAGES = 4, 8, 16, 32, 16
SRC_TP, DST_TP = 8, 4
SRC, DST = [0, 1, 2, 3], [9, 4, 12, 7]  # the request's pages on each side
OPTIONS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}
KEYS = xk.SessionKeys.generate()  # one CurveZMQ pair shared by every rank


def model() -> list[torch.Tensor]:
    """K then V of every layer, all heads, NHD: what the prefill instance holds in all."""
    gen = torch.Generator().manual_seed(0)
    shape = (PAGES, PAGE, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2 * LAYERS)]


def session(
    driver: str, kv: list[torch.Tensor], layout: pools.Layout, tp: int, r: int
) -> xk.Session:
    regions = pools.kv_pages("kv", k=kv[:LAYERS], v=kv[LAYERS:], layout=layout)
    manifest = xk.Manifest.build(regions, tp_rank=r, tp_size=tp)
    backend = xk.open_backend(driver, **OPTIONS[driver])
    # small staging (default 64 MiB): twelve ranks share this process
    return xk.Session(backend, manifest, keys=KEYS, staging_bytes=2**22, staging_slice_bytes=2**20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--driver", choices=sorted(OPTIONS), default="loopback")
    driver = parser.parse_args().driver
    whole = model()
    # prefill rank r: head r, NHD; decode rank d: heads 2d, 2d+1, HND (zeros until written)
    src = [[t.chunk(SRC_TP, 2)[r].contiguous() for t in whole] for r in range(SRC_TP)]
    dst = [[torch.zeros(PAGES, KV_HEADS // DST_TP, PAGE, HEAD_DIM, dtype=torch.bfloat16)
            for _ in whole] for _ in range(DST_TP)]  # fmt: skip
    prefill = [session(driver, kv, "NHD", SRC_TP, r) for r, kv in enumerate(src)]
    decode = [session(driver, kv, "HND", DST_TP, d) for d, kv in enumerate(dst)]
    try:
        sources = [s.address for s in prefill]
        recvs = [s.expect("req-0", source=sources, slots={"kv": DST}) for s in decode]
        sends = [s.offer("req-0") for s in prefill]
        for send in sends:
            send.write({"kv": SRC}, last=True)
        for handle in recvs + sends:
            handle.wait(timeout=60)
        moved = sum(h.routes.staged_bytes + h.routes.direct_bytes for h in sends)
    finally:
        for s in prefill + decode:
            s.close()
    bad = []
    for d, kv in enumerate(dst):
        for i, (got, t) in enumerate(zip(kv, whole, strict=True)):
            want = torch.zeros_like(got)
            want[DST] = t.chunk(DST_TP, 2)[d][SRC].transpose(1, 2)  # NHD -> HND
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                bad.append(f"decode rank {d} {'kv'[i // LAYERS]}[{i % LAYERS}]")
    print(f"{driver}: TP {SRC_TP} -> {DST_TP}, {len(SRC)} pages, {moved} B moved")
    if bad:
        print(f"MISMATCH in {bad}")
        return 1
    print(f"all {DST_TP} decode ranks hold their heads of the prefill pages byte-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
