"""Loopback throughput against single-core numpy.copyto of the same bytes, in one run.

For each descriptor size the same buffer is moved three ways, alternating:
``numpy.copyto`` of the whole buffer (one memcpy: the ceiling), the loopback
in this process, and the loopback into another process (process_vm_writev).
Descriptors are shuffled blocks, as a paged KV cache would produce. Prints a
table and writes benchmarks/results/loopback.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from report import default_out, save

import xferkit as xk
from xferkit.testing.peer import PeerProcess, Setup
from xferkit.testing.reference import RegionSpec

SIZES = [4 << 10, 64 << 10, 1 << 20]


def _descs(src: int, dst: int, total: int, size: int, rng) -> xk.Descriptors:
    n = total // size
    order = rng.permutation(n).astype(np.uint64)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return xk.Descriptors(
        np.uint64(src) + offs,
        np.uint64(dst) + order * np.uint64(size),
        np.full(n, size, dtype=np.uint64),
    )


def _median_time(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


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
            d_local = _descs(src.ctypes.data, dst.ctypes.data, total, size, rng)
            d_remote = _descs(src.ctypes.data, remote_addr, total, size, rng)
            local_src.write(peer, d_local).wait()  # warm
            local_src.write(remote, d_remote).wait()
            t_copy, t_local, t_remote = [], [], []
            for _ in range(repeat):
                t_copy.append(_median_time(lambda: np.copyto(dst, src), 1))
                t_local.append(_median_time(lambda d=d_local: local_src.write(peer, d).wait(), 1))
                t_remote.append(
                    _median_time(lambda d=d_remote: local_src.write(remote, d).wait(), 1)
                )
            # The moved bytes are right: block i of src sits at block order[i] of dst.
            order = ((d_local.dst - np.uint64(dst.ctypes.data)) // np.uint64(size)).astype(np.int64)
            assert np.array_equal(dst.reshape(-1, size)[order], src.reshape(-1, size))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per run, in MiB")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=default_out("loopback"))
    args = parser.parse_args()
    rows = run(args.mib, args.repeat)
    print(
        f"{'desc size':>10}{'descs':>9}{'copyto GB/s':>13}{'loopback GB/s':>15}{'ratio':>7}"
        f"{'Mdesc/s':>9}{'x-proc GB/s':>13}{'ratio':>7}{'Mdesc/s':>9}"
    )
    for r in rows:
        print(
            f"{r['descriptor_bytes'] >> 10:>8}Ki{r['descriptors']:>9,}{r['copyto_gbps']:>13.2f}"
            f"{r['loopback_gbps']:>15.2f}{r['ratio']:>7.2f}{r['loopback_mdesc_s']:>9.2f}"
            f"{r['cross_process_gbps']:>13.2f}{r['cross_process_ratio']:>7.2f}"
            f"{r['cross_process_mdesc_s']:>9.2f}"
        )
    save(args.out, rows, mib=args.mib, repeat=args.repeat)


if __name__ == "__main__":
    main()
