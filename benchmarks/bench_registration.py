"""Registering many regions: ``register``, ``endpoint`` and ``deregister`` for 1k to 100k regions.

Engines with many layers, streams and parts register thousands of regions
(issue 9, item 21: Mooncake once took 18 minutes for 100,000). Each backend
(loopback; mooncake over tcp on 127.0.0.1; nixl over UCX host memory) gets
the same regions of 4 KiB, in two layouts:

* carved: side by side in one buffer, as the layers, streams and parts of a
  KV pool are. Mooncake registers each run of touching regions as one engine
  buffer, so this is the common case.
* gapped: a 4 KiB hole after every region, so nothing can be joined. This is
  the engines' own worst case, a region per allocation.

A fresh backend per measurement; ``register`` includes the driver's
registration and the core's checks, ``deregister`` the release of every
region. A size is skipped when the growth measured so far predicts more than
``--budget`` seconds for it; the row then carries that prediction instead of
a time. Prints a table and writes benchmarks/results/registration.json.
Run: ``python benchmarks/bench_registration.py``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from report import Column, header, line, parser, save, timed

import xferkit as xk

SIZES = [1_000, 10_000, 100_000]
REGION = 4096
BACKENDS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}
LAYOUTS = {"carved": 0, "gapped": REGION}  # bytes between regions


def manifest(n: int, gap: int) -> tuple[np.ndarray, xk.Manifest, float]:
    """``n`` regions of ``REGION`` bytes in one buffer, ``gap`` bytes apart; the build time."""
    step = REGION + gap
    buffer = np.zeros(n * step, np.uint8)
    base = buffer.ctypes.data
    regions = [
        xk.Region(
            pool="kv",
            name="blk",
            layer=i,
            addr=base + i * step,
            nbytes=REGION,
            slot_shape=(REGION,),
            itemsize=1,
        )
        for i in range(n)
    ]
    started = time.perf_counter()
    m = xk.Manifest.build(regions)
    return buffer, m, time.perf_counter() - started


def measure(backend: str, options: dict[str, Any], m: xk.Manifest) -> dict[str, float]:
    with xk.open_backend(backend, **options) as b:
        return {  # in this order: what registered is what the endpoint and deregister see
            "register_s": timed(lambda: b.register(m))[0],
            "endpoint_s": timed(b.endpoint)[0],
            "deregister_s": timed(b.deregister)[0],
        }


def predict(done: list[tuple[int, float]], n: int) -> float:
    """Seconds for ``n`` regions, extrapolated from the growth seen (quadratic from one point)."""
    if len(done) >= 2:
        (n0, s0), (n1, s1) = done[-2], done[-1]
        power = max(1.0, math.log(max(s1, 1e-6) / max(s0, 1e-6)) / math.log(n1 / n0))
    else:
        power = 2.0
    n_last, s_last = done[-1]
    return s_last * (n / n_last) ** power


COLUMNS = [
    Column("backend", "backend", width=10, left=True),
    Column("layout", "layout", width=8, left=True),
    Column("regions", "regions", ",", 8),
    Column("register", lambda r: f"{r['register_s']:.3f}s", width=11),
    Column("endpoint", lambda r: f"{r['endpoint_s']:.3f}s", width=10),
    Column("deregister", lambda r: f"{r['deregister_s']:.3f}s", width=12),
    Column("per region", lambda r: f"{r['per_region_us']:.1f}us", width=12),
]


def main() -> None:
    args = parser("registration", __doc__.splitlines()[0] if __doc__ else None)
    args.add_argument("--backends", nargs="*", default=list(BACKENDS))
    args.add_argument("--sizes", nargs="*", type=int, default=SIZES)
    args.add_argument("--budget", type=float, default=120.0, help="seconds per measurement")
    a = args.parse_args()
    available = {b.name: b for b in xk.backends()}
    rows: list[dict[str, Any]] = []
    builds: dict[tuple[str, int], float] = {}
    print(header(COLUMNS))
    for backend in a.backends:
        info = available.get(backend)
        if info is None or not info.available:
            print(f"{backend:<9} not available here: {info.reason if info else 'unknown'}")
            continue
        for layout, gap in LAYOUTS.items():
            done: list[tuple[int, float]] = []
            for n in sorted(a.sizes):
                row: dict[str, Any] = {"backend": backend, "layout": layout, "regions": n}
                if done and (guess := predict(done, n)) > a.budget:
                    row["skipped"] = f"predicted {guess:.0f} s > budget {a.budget:.0f} s"
                    row["predicted_s"] = guess
                    rows.append(row)
                    print(f"{backend:<9} {layout:<7} {n:>8,} skipped: {row['skipped']}")
                    continue
                buffer, m, build_s = manifest(n, gap)
                builds[(layout, n)] = build_s
                row.update(measure(backend, BACKENDS[backend], m))
                del m, buffer
                total = row["register_s"] + row["deregister_s"]
                row["per_region_us"] = total / n * 1e6
                done.append((n, total))
                rows.append(row)
                print(line(row, COLUMNS))
    for (layout, n), s in sorted(builds.items()):
        print(f"Manifest.build, {layout}, {n:,} regions: {s:.3f} s")
    save(
        a.out,
        rows,
        region_bytes=REGION,
        budget_s=a.budget,
        manifest_build_s={f"{layout}/{n}": s for (layout, n), s in sorted(builds.items())},
    )


if __name__ == "__main__":
    main()
