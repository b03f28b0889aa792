"""What every benchmark script shares: where results go and what is recorded beside them."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

import xferkit as xk

RESULTS = Path(__file__).parent / "results"

HEADS, HEAD_DIM, PAGE, BF16 = 8, 128, 64, 2
"""A Llama-70B-shaped KV layer set: 8 KV heads of 128, bf16, pages of 64 tokens."""


def kv_manifest(
    layout: str, tp: int, rank: int, layers: int, pages: int, seed: int, page: int = PAGE
) -> tuple[xk.Manifest, list[np.ndarray]]:
    """One rank's k and v pages of ``page`` tokens, NHD or HND (axes named, so either side may
    use either), random bytes (the tests check correctness)."""
    heads = HEADS // tp
    shape, axis = ((page, heads, HEAD_DIM), 1) if layout == "NHD" else ((heads, page, HEAD_DIM), 0)
    axes = ("token", "head", "dim") if layout == "NHD" else ("head", "token", "dim")
    rng = np.random.default_rng(seed)
    arrays, regions = [], []
    for layer in range(layers):
        for name in "kv":
            a = rng.integers(0, 256, (pages, *shape[:-1], HEAD_DIM * BF16), dtype=np.uint8)
            arrays.append(a)
            regions.append(
                xk.Region(
                    pool="kv",
                    name=name,
                    layer=layer,
                    addr=a.ctypes.data,
                    nbytes=a.nbytes,
                    slot_shape=shape,
                    itemsize=BF16,
                    tp_axis=axis,
                    axes=axes,
                )
            )
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp), arrays


def default_out(name: str) -> str:
    return str(RESULTS / f"{name}.json")


def save(out: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    """Write rows and the run's circumstances as JSON; say where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        **meta,
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
