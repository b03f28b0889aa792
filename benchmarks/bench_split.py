"""Split writes: one write cut into several driver batches (``max_batch``), to done.

Without a notification every batch goes out at once; with one, the last batch
(carrying it) waits until the others are done. Each row times a write of
``--mib`` MiB in shuffled blocks, median of ``--repeat`` runs, on the loopback
and on Mooncake over TCP (127.0.0.1), with and without a notification.
Prints a table and writes benchmarks/results/split.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from report import default_out, save

import xferkit as xk

BLOCK = 64 << 10
BATCHES = [1, 4, 16]
POLL_S = 0.002
"""An engine's event loop polls its writes about this often (``poll`` rows); ``wait`` rows
block in ``Transfer.wait``."""
DRIVERS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
}


def _descs(src: int, dst: int, total: int, size: int, rng: np.random.Generator) -> xk.Descriptors:
    n = total // size
    order = rng.permutation(n).astype(np.uint64)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return xk.Descriptors(
        np.uint64(src) + offs,
        np.uint64(dst) + order * np.uint64(size),
        np.full(n, size, dtype=np.uint64),
    )


def _region(a: np.ndarray, name: str) -> xk.Region:
    return xk.Region.from_array(a, pool=name, name=name, layer=0)


def run(total_mib: int, repeat: int) -> list[dict[str, Any]]:
    total = total_mib << 20
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.ones(total, dtype=np.uint8)  # faulted in before timing
    descs = _descs(src.ctypes.data, dst.ctypes.data, total, BLOCK, rng)
    rows = []
    for driver, options in DRIVERS.items():
        for batches in BATCHES:
            step = -(-len(descs) // batches)
            a = xk.open_backend(driver, **options, max_batch=step)
            b = xk.open_backend(driver, **options)
            try:
                a.register(xk.Manifest.build([_region(src, "src")]))
                dst_m = xk.Manifest.build([_region(dst, "dst")])
                b.register(dst_m)
                peer = a.connect(b.endpoint(), dst_m)
                for notify in (None, b"done"):
                    a.write(peer, descs, notify).wait(60)  # warm
                    for mode in ("wait", "poll"):
                        runs = []
                        for _ in range(repeat):
                            t = time.perf_counter()
                            w = a.write(peer, descs, notify)
                            if mode == "wait":
                                w.wait(60)
                            else:
                                while w.poll() is xk.Status.PENDING:
                                    time.sleep(POLL_S)
                            runs.append(time.perf_counter() - t)
                        if notify is not None:
                            b.notifications(timeout=1.0)
                        s = statistics.median(runs)
                        rows.append(
                            {
                                "driver": driver,
                                "batches": batches,
                                "notify": notify is not None,
                                "mode": mode,
                                "ms": s * 1e3,
                                "gbps": total / s / 1e9,
                            }
                        )
            finally:
                try:
                    a.close()
                finally:
                    b.close()
    order = ((descs.dst - np.uint64(dst.ctypes.data)) // np.uint64(BLOCK)).astype(np.int64)
    assert np.array_equal(dst.reshape(-1, BLOCK)[order], src.reshape(-1, BLOCK))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="bytes moved per write, in MiB")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--out", default=default_out("split"))
    args = parser.parse_args()
    rows = run(args.mib, args.repeat)
    print(f"{'driver':>10}{'batches':>9}{'notify':>8}{'mode':>6}{'ms':>9}{'GB/s':>8}")
    for r in rows:
        print(
            f"{r['driver']:>10}{r['batches']:>9}{'yes' if r['notify'] else 'no':>8}"
            f"{r['mode']:>6}{r['ms']:>9.2f}{r['gbps']:>8.2f}"
        )
    save(args.out, rows, mib=args.mib, repeat=args.repeat)


if __name__ == "__main__":
    main()
