"""Plan.expand on a Llama-70B-shaped request and a Mamba hybrid.

Prints a table and writes benchmarks/results/expand.json. Planning touches no
memory, so regions get synthetic, non-overlapping addresses: the numbers are
the planner's cost alone. Run: `make bench` or `python benchmarks/bench_expand.py`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
from report import default_out, save

import xferkit as xk

LAYERS, KV_HEADS, HEAD_DIM, PAGE, TOKENS, BF16 = 80, 8, 128, 64, 8192, 2
POOL_PAGES = 4096  # pages each rank's pool holds


class _Addresses:
    """Hands out non-overlapping fake addresses."""

    def __init__(self) -> None:
        self.next = 1 << 30

    def take(self, nbytes: int) -> int:
        addr = self.next
        self.next += nbytes + 4096
        return addr


def _kv_regions(tp: int, layout: str, layers: list[int], heads: int, head_dim: int, mem):
    local = max(1, heads // tp)
    tp_global = heads if local * tp != heads else None
    shape = (PAGE, local, head_dim) if layout == "NHD" else (local, PAGE, head_dim)
    axis = 1 if layout == "NHD" else 0
    nbytes = POOL_PAGES * math.prod(shape) * BF16
    return [
        xk.Region(
            pool="kv",
            name=name,
            layer=layer,
            addr=mem.take(nbytes),
            nbytes=nbytes,
            slot_shape=shape,
            itemsize=BF16,
            tp_axis=axis,
            tp_global=tp_global,
        )
        for layer in layers
        for name in ("k", "v")
    ]


def llama(tp: int, rank: int, layout: str) -> xk.Manifest:
    regions = _kv_regions(tp, layout, list(range(LAYERS)), KV_HEADS, HEAD_DIM, _Addresses())
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp)


# A Qwen3-Next-shaped hybrid: 48 layers, every 4th full attention, the rest gated delta net.
HYBRID_LAYERS, STATE_SLOTS = 48, 512
CONV_GROUPS, CONV_WINDOW = (2048, 2048, 4096), 3  # [q | k | v] channels, kernel - 1
V_HEADS, K_DIM, V_DIM = 32, 128, 128


def hybrid(tp: int, rank: int) -> xk.Manifest:
    mem = _Addresses()
    attn = [layer for layer in range(HYBRID_LAYERS) if layer % 4 == 3]
    regions = _kv_regions(tp, "NHD", attn, heads=2, head_dim=256, mem=mem)
    for layer in range(HYBRID_LAYERS):
        if layer in attn:
            continue
        conv = (CONV_WINDOW, sum(CONV_GROUPS) // tp)
        temporal = (V_HEADS // tp, K_DIM, V_DIM)
        for name, shape, itemsize, groups in (
            ("conv", conv, BF16, CONV_GROUPS),
            ("temporal", temporal, 4, None),
        ):
            nbytes = STATE_SLOTS * math.prod(shape) * itemsize
            regions.append(
                xk.Region(
                    pool="state",
                    name=name,
                    layer=layer,
                    addr=mem.take(nbytes),
                    nbytes=nbytes,
                    slot_shape=shape,
                    itemsize=itemsize,
                    tp_axis=1 if name == "conv" else 0,
                    tp_groups=groups,
                )
            )
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp)


def _pages(rng: np.random.Generator, count: int, scattered: bool) -> np.ndarray:
    if scattered:
        return rng.choice(POOL_PAGES, count, replace=False)
    return np.arange(100, 100 + count)


def _scan(d: xk.Descriptors, src: xk.Manifest, dst: xk.Manifest) -> None:
    """The core's bounds scan, which plan-made descriptors skip (what hand-made ones cost)."""
    for addrs, m in ((d.src, src), (d.dst, dst)):
        assert m.first_outside(addrs, d.nbytes) < 0


def _time(fn, repeat: int) -> float:
    fn()  # warm
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def run(repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    pages = TOKENS // PAGE
    cases = [
        ("llama70b 8->8 NHD", lambda: (llama(8, 0, "NHD"), llama(8, 0, "NHD")), False),
        ("llama70b 4->8 NHD", lambda: (llama(4, 0, "NHD"), llama(8, 1, "NHD")), False),
        ("llama70b 4->8 HND", lambda: (llama(4, 0, "HND"), llama(8, 1, "HND")), False),
        ("llama70b 8->4 NHD", lambda: (llama(8, 1, "NHD"), llama(4, 0, "NHD")), False),
        ("qwen3next-hybrid 2->4", lambda: (hybrid(2, 0), hybrid(4, 1)), True),
    ]
    rows = []
    for name, build, has_state in cases:
        src, dst = build()
        t = time.perf_counter()
        p = xk.plan(src, dst)
        plan_s = time.perf_counter() - t
        kv_layers = len({k[2] for k in dst.keys if k[0] == "kv"})
        state_regions = sum(1 for k in dst.keys if k[0] == "state")
        naive = 2 * kv_layers * pages * PAGE + state_regions
        for scattered in (False, True):
            slots = {"kv": (_pages(rng, pages, scattered), _pages(rng, pages, scattered))}
            if has_state:
                slots["state"] = (np.array([7]), np.array([11]))
            descs = p.expand(slots)
            rows.append(
                {
                    "case": name,
                    "pages": "scattered" if scattered else "contiguous",
                    "descriptors": len(descs),
                    "per_token_slot": naive,
                    "bytes": descs.total_bytes,
                    "expand_us": _time(lambda s=slots, p=p: p.expand(s), repeat) * 1e6,
                    "plan_ms": plan_s * 1e3,
                    "scan_us": _time(lambda d=descs, m=(src, dst): _scan(d, *m), repeat) * 1e6,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--out", default=default_out("expand"))
    args = parser.parse_args()
    rows = run(args.repeat)
    head = f"{'case':<24}{'pages':<12}{'descriptors':>12}{'per-token':>11}{'MiB':>9}"
    print(head + f"{'expand us':>11}{'plan ms':>9}{'scan us':>9}")
    for r in rows:
        print(
            f"{r['case']:<24}{r['pages']:<12}{r['descriptors']:>12,}{r['per_token_slot']:>11,}"
            f"{r['bytes'] / 2**20:>9.1f}{r['expand_us']:>11.0f}{r['plan_ms']:>9.1f}"
            f"{r['scan_us']:>9.0f}"
        )
    save(args.out, rows, repeat=args.repeat)


if __name__ == "__main__":
    main()
