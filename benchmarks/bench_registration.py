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

import argparse
import math
import time
from typing import Any

import numpy as np
from report import default_out, save

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
        t0 = time.perf_counter()
        b.register(m)
        t1 = time.perf_counter()
        b.endpoint()
        t2 = time.perf_counter()
        b.deregister()
        t3 = time.perf_counter()
    return {"register_s": t1 - t0, "endpoint_s": t2 - t1, "deregister_s": t3 - t2}


def predict(done: list[tuple[int, float]], n: int) -> float:
    """Seconds for ``n`` regions, extrapolated from the growth seen (quadratic from one point)."""
    if len(done) >= 2:
        (n0, s0), (n1, s1) = done[-2], done[-1]
        power = max(1.0, math.log(max(s1, 1e-6) / max(s0, 1e-6)) / math.log(n1 / n0))
    else:
        power = 2.0
    n_last, s_last = done[-1]
    return s_last * (n / n_last) ** power


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS))
    parser.add_argument("--sizes", nargs="*", type=int, default=SIZES)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per measurement")
    parser.add_argument("--out", default=default_out("registration"))
    args = parser.parse_args()
    available = {b.name: b for b in xk.backends()}
    rows: list[dict[str, Any]] = []
    builds: dict[tuple[str, int], float] = {}
    print(
        f"{'backend':<9} {'layout':<7} {'regions':>8} {'register':>10} {'endpoint':>9} "
        f"{'deregister':>11} {'per region':>11}"
    )
    for backend in args.backends:
        info = available.get(backend)
        if info is None or not info.available:
            print(f"{backend:<9} not available here: {info.reason if info else 'unknown'}")
            continue
        for layout, gap in LAYOUTS.items():
            done: list[tuple[int, float]] = []
            for n in sorted(args.sizes):
                row: dict[str, Any] = {"backend": backend, "layout": layout, "regions": n}
                if done and (guess := predict(done, n)) > args.budget:
                    row["skipped"] = f"predicted {guess:.0f} s > budget {args.budget:.0f} s"
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
                print(
                    f"{backend:<9} {layout:<7} {n:>8,} {row['register_s']:>9.3f}s "
                    f"{row['endpoint_s']:>8.3f}s {row['deregister_s']:>10.3f}s "
                    f"{row['per_region_us']:>9.1f}us"
                )
    for (layout, n), s in sorted(builds.items()):
        print(f"Manifest.build, {layout}, {n:,} regions: {s:.3f} s")
    save(
        args.out,
        rows,
        region_bytes=REGION,
        budget_s=args.budget,
        manifest_build_s={f"{layout}/{n}": s for (layout, n), s in sorted(builds.items())},
    )


if __name__ == "__main__":
    main()
