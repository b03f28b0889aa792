"""Loopback throughput against single-core numpy.copyto of the same bytes, in one run.

For each descriptor size the same buffer is moved three ways, alternating:
``numpy.copyto`` of the whole buffer (one memcpy: the ceiling), the loopback
in this process, and the loopback into another process (process_vm_writev).
Descriptors are shuffled blocks, as a paged KV cache would produce. Prints a
table and writes benchmarks/results/loopback.json.
"""

from __future__ import annotations

import functools
import statistics

import numpy as np
from report import Column, check_shuffled, kib, script, shuffled_blocks, timed

import xferkit as xk
from xferkit.testing.peer import PeerProcess, Setup
from xferkit.testing.reference import RegionSpec

SIZES = [4 << 10, 64 << 10, 1 << 20]


def _write(b: xk.Backend, peer: xk.Peer, d: xk.Descriptors) -> None:
    b.write(peer, d).wait()


def run(total_mib: int, repeat: int) -> list[dict]:
    total = total_mib << 20
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    dst[:] = 1  # fault the pages in before timing
    region = lambda a, name: xk.Region.from_array(a, pool=name, name=name, layer=0)  # noqa: E731
    local_src = xk.open_backend("loopback")
    local_dst = xk.open_backend("loopback")
    local_src.register(xk.Manifest.build([region(src, "src")]))
    dst_manifest = xk.Manifest.build([region(dst, "dst")])
    local_dst.register(dst_manifest)
    peer = local_src.connect(local_dst.endpoint(), dst_manifest)

    spec = RegionSpec(pool="raw", name="buf", layer=0, shape=(1 << 20,), itemsize=1)
    proc = PeerProcess()
    ready = proc.ask(
        Setup(
            backend="loopback",
            options={},
            specs=[spec],
            src_tp=1,
            dst_tp=1,
            src_slots={"raw": 1},
            dst_slots={"raw": total_mib},
            role="dst",
            index=0,
        )
    )
    remote_manifest = xk.Manifest.decode(ready.manifest)
    remote = local_src.connect(ready.endpoint, remote_manifest)
    remote_addr = remote_manifest.regions[0].addr

    rows = []
    try:
        for size in SIZES:
            d_local = shuffled_blocks(src.ctypes.data, dst.ctypes.data, total, size, rng)
            d_remote = shuffled_blocks(src.ctypes.data, remote_addr, total, size, rng)
            local_src.write(peer, d_local).wait()  # warm
            local_src.write(remote, d_remote).wait()
            t_copy: list[float] = []
            t_local: list[float] = []
            t_remote: list[float] = []
            for _ in range(repeat):  # alternating, so drift hits all three alike
                t_copy += timed(lambda: np.copyto(dst, src))
                t_local += timed(functools.partial(_write, local_src, peer, d_local))
                t_remote += timed(functools.partial(_write, local_src, remote, d_remote))
            check_shuffled(d_local, src, dst, dst.ctypes.data, size)
            copy_s, local_s, remote_s = (statistics.median(t) for t in (t_copy, t_local, t_remote))
            n = len(d_local)
            rows.append(
                {
                    "descriptor_bytes": size,
                    "descriptors": n,
                    "copyto_gbps": total / copy_s / 1e9,
                    "loopback_gbps": total / local_s / 1e9,
                    "ratio": copy_s / local_s,
                    "loopback_mdesc_s": n / local_s / 1e6,
                    "cross_process_gbps": total / remote_s / 1e9,
                    "cross_process_ratio": copy_s / remote_s,
                    "cross_process_mdesc_s": n / remote_s / 1e6,
                }
            )
    finally:
        proc.close()
        local_src.close()
        local_dst.close()
    return rows


COLUMNS = [
    Column("desc size", kib("descriptor_bytes")),
    Column("descs", "descriptors", ",", 9),
    Column("copyto GB/s", "copyto_gbps", ".2f", 13),
    Column("loopback GB/s", "loopback_gbps", ".2f", 15),
    Column("ratio", "ratio", ".2f", 7),
    Column("Mdesc/s", "loopback_mdesc_s", ".2f", 9),
    Column("x-proc GB/s", "cross_process_gbps", ".2f", 13),
    Column("ratio", "cross_process_ratio", ".2f", 7),
    Column("Mdesc/s", "cross_process_mdesc_s", ".2f", 9),
]


def main() -> None:
    script(
        "loopback",
        __doc__,
        run,
        COLUMNS,
        {"mib": (256, "bytes moved per run, in MiB"), "repeat": (7, None)},
    )


if __name__ == "__main__":
    main()
