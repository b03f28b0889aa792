"""Split writes: one write cut into several driver batches (``max_batch``), to done.

Without a notification every batch goes out at once; with one, the last batch
(carrying it) waits until the others are done. Each row times a write of
``--mib`` MiB in shuffled blocks, median of ``--repeat`` runs, on the loopback
and on Mooncake over TCP (127.0.0.1), with and without a notification.
Prints a table and writes benchmarks/results/split.json.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
from report import Column, check_shuffled, script, shuffled_blocks, timed

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


def _region(a: np.ndarray, name: str) -> xk.Region:
    return xk.Region.from_array(a, pool=name, name=name, layer=0)


def _write(
    a: xk.Backend, peer: xk.Peer, descs: xk.Descriptors, notify: bytes | None, mode: str
) -> None:
    """One write to done: blocking in ``wait``, or polled as an engine's loop would."""
    w = a.write(peer, descs, notify)
    if mode == "wait":
        w.wait(60)
    else:
        while w.poll() is xk.Status.PENDING:
            time.sleep(POLL_S)


def run(total_mib: int, repeat: int) -> list[dict[str, Any]]:
    total = total_mib << 20
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.ones(total, dtype=np.uint8)  # faulted in before timing
    descs = shuffled_blocks(src.ctypes.data, dst.ctypes.data, total, BLOCK, rng)
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
                        write = functools.partial(_write, a, peer, descs, notify, mode)
                        s = timed(write, repeat).median
                        if notify is not None:
                            b.notifications(timeout=1.0)
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
    check_shuffled(descs, src, dst, dst.ctypes.data, BLOCK)
    return rows


COLUMNS = [
    Column("driver", "driver"),
    Column("batches", "batches", width=9),
    Column("notify", lambda r: "yes" if r["notify"] else "no", width=8),
    Column("mode", "mode", width=6),
    Column("ms", "ms", ".2f", 9),
    Column("GB/s", "gbps", ".2f", 8),
]


def main() -> None:
    script(
        "split",
        __doc__,
        run,
        COLUMNS,
        {"mib": (64, "bytes moved per write, in MiB"), "repeat": (9, None)},
    )


if __name__ == "__main__":
    main()
