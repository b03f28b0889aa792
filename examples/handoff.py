"""A prefill -> decode handoff of paged KV cache, end to end, through a real driver.

Prefill runs at TP 2, decode at TP 4; each rank is a backend of its own (the
loopback by default; pass ``mooncake`` or ``nixl`` to use those). Run:

    python examples/handoff.py [backend]
"""

from __future__ import annotations

import sys

import numpy as np

import xferkit as xk

LAYERS, KV_HEADS, PAGE, HEAD_DIM = 4, 8, 16, 64


def kv_cache(tp: int, pages: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One rank's K and V pages per layer: [pages, page, local heads, head_dim] (NHD)."""
    shape = (pages, PAGE, KV_HEADS // tp, HEAD_DIM)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(2 * LAYERS)]


def manifest(cache: list[np.ndarray], tp: int, rank: int) -> xk.Manifest:
    regions = [
        xk.Region.from_array(a, pool="kv", name="kv"[i % 2], layer=i // 2, tp_axis=1)
        for i, a in enumerate(cache)
    ]
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp)


def main(backend: str = "loopback") -> None:
    rng = np.random.default_rng(0)
    prefill = [kv_cache(2, 32, rng) for _ in range(2)]
    decode = [kv_cache(4, 48, rng) for _ in range(4)]
    p_man = [manifest(c, 2, r) for r, c in enumerate(prefill)]
    d_man = [manifest(c, 4, r) for r, c in enumerate(decode)]
    p_back = [xk.open_backend(backend) for _ in p_man]
    d_back = [xk.open_backend(backend) for _ in d_man]
    try:
        for b, m in zip(p_back + d_back, p_man + d_man, strict=True):
            b.register(m)
        src_pages, dst_pages = np.array([3, 4, 5, 9]), np.array([40, 41, 42, 7])
        for d, (backend_d, man_d) in enumerate(zip(d_back, d_man, strict=True)):
            cov = xk.coverage(p_man, man_d)  # once per rank pair in a real engine
            for s in cov.sources:
                peer = p_back[s].connect(backend_d.endpoint(), man_d)
                descs = cov.plans[s].expand({"kv": (src_pages, dst_pages)})
                p_back[s].write(peer, descs, notify=b"req-1").wait(timeout=30)
                print(f"prefill {s} -> decode {d}: {len(descs)} descriptors, {descs.total_bytes} B")
            # Check: decode rank d holds heads [2d, 2d+2) of the page; prefill rank d//2 held
            # heads [4*(d//2), 4*(d//2)+4).
            lo = 2 * d - 4 * (d // 2)
            for i in range(2 * LAYERS):
                want = prefill[d // 2][i][src_pages][:, :, lo : lo + 2]
                assert np.array_equal(decode[d][i][dst_pages], want), (d, i)
        print("all decode ranks hold the prefill pages byte-exact")
    finally:
        for b in p_back + d_back:
            b.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
