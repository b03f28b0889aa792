"""Plan.expand on a Llama-70B-shaped request and a Mamba hybrid.

Prints a table and writes benchmarks/results/expand.json. Planning touches no
memory, so regions get synthetic, non-overlapping addresses: the numbers are
the planner's cost alone. Run: `make bench` or `python benchmarks/bench_expand.py`.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
from report import Column, script, timed

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
            expand = timed(functools.partial(p.expand, slots), repeat, warm=True)
            scan = timed(functools.partial(_scan, descs, src, dst), repeat, warm=True)
            rows.append(
                {
                    "case": name,
                    "pages": "scattered" if scattered else "contiguous",
                    "descriptors": len(descs),
                    "per_token_slot": naive,
                    "bytes": descs.total_bytes,
                    "expand_us": expand.median * 1e6,
                    "plan_ms": plan_s * 1e3,
                    "scan_us": scan.median * 1e6,
                }
            )
    return rows


COLUMNS = [
    Column("case", "case", width=24, left=True),
    Column("pages", "pages", width=12, left=True),
    Column("descriptors", "descriptors", ",", 12),
    Column("per-token", "per_token_slot", ",", 11),
    Column("MiB", lambda r: r["bytes"] / 2**20, ".1f", 9),
    Column("expand us", "expand_us", ".0f", 11),
    Column("plan ms", "plan_ms", ".1f", 9),
    Column("scan us", "scan_us", ".0f", 9),
]


def main() -> None:
    script("expand", __doc__, run, COLUMNS, {"repeat": (21, None)})


if __name__ == "__main__":
    main()
