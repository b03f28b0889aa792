"""Mooncake plugin throughput against raw ``TransferEngine.batch_transfer_sync_write``.

One run, two processes on 127.0.0.1 over Mooncake's TCP transport: a peer
process (``xferkit.testing.peer``) registers a destination buffer with the
mooncake backend; this process sends the same descriptors (shuffled blocks,
as a paged KV cache would produce) through the plugin (``write().wait()``) and
through raw ``batch_transfer_sync_write`` calls, alternating which goes first.
The raw calls go through the plugin's own engine, hence the same TCP
connection: Mooncake's TCP throughput differs from one engine (connection) to
the next by up to 2x and stays so (measured: four engines in one process,
12 writes each, settled at 49, 49, 64 and 88 ms for the same 64 MiB), so two
engines would compare connections, not the plugin. Raw calls get the
descriptors as ready-made lists in chunks of at most 1024 (the TCP
transport's per-peer queue limit; a bigger batch fails); the plugin pays for
its own conversions. The ratio reported is the median over reps of raw
time / plugin time, each rep timing both paths back to back (>= 1 means the
plugin is at least as fast); the ratios of the medians and of the best times
are printed beside it. On a shared machine the engine's own time varies by
more than the plugin adds, so the plugin's time outside the engine calls is
measured too (the driver's engine is wrapped in a proxy that times its batch
calls) and reported as overhead.
Prints a table and writes
benchmarks/results/mooncake.json.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from mooncake.engine import TransferEngine
from report import Column, check_shuffled, kib, script, shuffled_blocks, timed

import xferkit as xk
from xferkit.testing.peer import PeerProcess, Setup
from xferkit.testing.reference import RegionSpec
from xferkit_mooncake.backend import MooncakeDriver

SIZES = [4 << 10, 64 << 10, 1 << 20]
OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}
CHUNK = 1024


def _raw_chunks(d: xk.Descriptors) -> list[tuple[list[int], list[int], list[int]]]:
    s, t, n = d.src.tolist(), d.dst.tolist(), d.nbytes.tolist()
    return [(s[i : i + CHUNK], t[i : i + CHUNK], n[i : i + CHUNK]) for i in range(0, len(s), CHUNK)]


class _TimedEngine:
    """The real engine; the seconds spent in its transfer calls are written down."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.seconds: list[float] = []

    def _timed(self, call: str, *args: Any) -> int:
        start = time.perf_counter()
        try:
            return int(getattr(self._engine, call)(*args))
        finally:
            self.seconds.append(time.perf_counter() - start)

    def batch_transfer_sync_write(self, *args: Any) -> int:
        return self._timed("batch_transfer_sync_write", *args)

    def batch_transfer_sync(self, *args: Any) -> int:
        return self._timed("batch_transfer_sync", *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def run(total_mib: int, repeat: int) -> list[dict]:
    total = total_mib << 20
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    back = np.zeros(total, dtype=np.uint8)
    proc = PeerProcess()
    ready = proc.ask(
        Setup(
            backend="mooncake",
            options=OPTIONS,
            specs=[RegionSpec(pool="raw", name="buf", layer=0, shape=(1 << 20,), itemsize=1)],
            src_tp=1,
            dst_tp=1,
            src_slots={"raw": 1},
            dst_slots={"raw": total_mib},
            role="dst",
            index=0,
        )
    )
    assert ready.ok, ready.error
    remote_manifest = xk.Manifest.decode(ready.manifest)
    remote_addr = remote_manifest.regions[0].addr

    plugin = xk.open_backend("mooncake", **OPTIONS)
    driver = plugin.driver
    assert isinstance(driver, MooncakeDriver)
    raw = driver.engine  # the same engine and connection (see above)
    inside = driver.engine = _TimedEngine(raw)  # before connect: the peer's lane calls it
    plugin.register(xk.Manifest.build([xk.Region.from_array(src, pool="src", name="src", layer=0)]))
    peer = plugin.connect(ready.endpoint, remote_manifest)
    segment = peer.name.removeprefix("mooncake:")  # the peer's address: its segment
    reader = TransferEngine()  # only reads the result back
    assert reader.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert reader.register_memory(back.ctypes.data, total) == 0

    def raw_write(chunks) -> None:
        for s, t, n in chunks:
            rc = raw.batch_transfer_sync_write(segment, s, t, n)
            assert rc == 0, rc

    rows = []
    try:
        for size in SIZES:
            d = shuffled_blocks(src.ctypes.data, remote_addr, total, size, rng)
            chunks = _raw_chunks(d)
            plugin.write(peer, d).wait()  # warm both paths
            raw_write(chunks)
            t_raw: list[float] = []
            t_plugin: list[float] = []
            overhead: list[float] = []
            for rep in range(repeat):
                runs = [(t_raw, lambda c=chunks: raw_write(c))]
                runs.append((t_plugin, lambda d=d: plugin.write(peer, d).wait()))
                for times, fn in runs if rep % 2 == 0 else runs[::-1]:
                    inside.seconds.clear()
                    times += timed(fn)
                    if times is t_plugin:
                        overhead.append(t_plugin[-1] - sum(inside.seconds))
            # The peer holds block i of src at block order[i]: read it back and compare.
            back[:] = 0
            assert (
                raw.batch_transfer_sync_read(segment, [back.ctypes.data], [remote_addr], [total])
                == 0
            )
            check_shuffled(d, src, back, remote_addr, size)
            raw_s, plugin_s = statistics.median(t_raw), statistics.median(t_plugin)
            # Each rep ran both back to back: the paired ratio cancels drift in the
            # machine's load, which the ratio of medians does not.
            paired = [r / p for r, p in zip(t_raw, t_plugin, strict=True)]
            rows.append(
                {
                    "descriptor_bytes": size,
                    "descriptors": len(d),
                    "raw_gbps": total / raw_s / 1e9,
                    "plugin_gbps": total / plugin_s / 1e9,
                    "ratio": statistics.median(paired),
                    "ratio_of_medians": raw_s / plugin_s,
                    "ratio_of_best": min(t_raw) / min(t_plugin),
                    "plugin_overhead_ms": statistics.median(overhead) * 1e3,
                    "plugin_overhead_share": statistics.median(
                        o / p for o, p in zip(overhead, t_plugin, strict=True)
                    ),
                    "raw_s": t_raw,
                    "plugin_s": t_plugin,
                }
            )
    finally:
        proc.close()
        plugin.close()
        reader.unregister_memory(back.ctypes.data)
    return rows


COLUMNS = [
    Column("desc size", kib("descriptor_bytes")),
    Column("descs", "descriptors", ",", 9),
    Column("raw GB/s", "raw_gbps", ".3f"),
    Column("plugin GB/s", "plugin_gbps", ".3f", 13),
    Column("paired ratio", "ratio", ".3f", 14),
    Column("of medians", "ratio_of_medians", ".3f", 12),
    Column("of best", "ratio_of_best", ".3f", 9),
    Column("overhead", lambda r: f"{r['plugin_overhead_ms']:.2f} ms", width=11),
    Column("share", "plugin_overhead_share", ".1%", 7),
]


def main() -> None:
    script(
        "mooncake",
        __doc__,
        run,
        COLUMNS,
        {"mib": (64, "bytes moved per run, in MiB"), "repeat": (7, None)},
        transport="mooncake tcp, 127.0.0.1, two processes",
    )


if __name__ == "__main__":
    main()
