"""Layer-wise writes: the transfer of each layer overlapping the compute of the next.

A prefill forward pass computes a request's KV layer by layer. Written whole, the transfer
starts when the last layer is done: expect -> DONE takes compute + transfer. Written layer
by layer (``Send.write(slots, layers=[i])`` as layer ``i`` is done) it takes about
max(compute, transfer) plus one layer's transfer. Both Sessions here (TP 1 -> 1, Llama-70B
KV shapes: ``HEADS`` heads of 128, bf16, pages of 16 tokens), the forward pass modelled as
``--compute-ms`` per layer of sleep (a GPU kernel does not hold the host's CPU), the two
variants alternating ``--repeat`` times per driver. Prints the medians and writes
benchmarks/results/layerwise.json. Run: ``python benchmarks/bench_layerwise.py``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from report import Column, header, kv_manifest, line, parser, save

import xferkit as xk
from xferkit.session import Session, State

OPTIONS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}


def one(pre: Session, dec: Session, rid: str, pages: int, layers: int, compute_s: float,
        layerwise: bool) -> float:  # fmt: skip
    """Seconds from the forward pass's start to DONE at the decode rank."""
    slots = list(range(pages))
    recv = dec.expect(rid, [pre.address], {"kv": slots})
    send = pre.offer(rid)
    start = time.perf_counter()
    for layer in range(layers):
        time.sleep(compute_s)  # the layer's compute
        if layerwise:
            send.write({"kv": slots}, last=layer == layers - 1, layers=[layer])
    if not layerwise:
        send.write({"kv": slots}, last=True)
    assert recv.wait(60) is State.DONE and send.wait(60) is State.DONE
    return time.perf_counter() - start


def run(driver: str, pages: int, layers: int, compute_s: float, repeat: int) -> dict[str, Any]:
    src, keep_src = kv_manifest("NHD", 1, 0, layers, pages, seed=1)
    dst, keep_dst = kv_manifest("NHD", 1, 0, layers, pages, seed=2)
    big = 256 << 20
    pre = Session(xk.open_backend(driver, **OPTIONS[driver]), src, staging="never",
                  staging_bytes=big)  # fmt: skip
    dec = Session(xk.open_backend(driver, **OPTIONS[driver]), dst, staging="never",
                  staging_bytes=big)  # fmt: skip
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        one(pre, dec, "warm", pages, layers, 0.0, False)
        for i in range(repeat):
            for layerwise in (False, True):
                rid = f"{i}-{layerwise}"
                times[layerwise].append(one(pre, dec, rid, pages, layers, compute_s, layerwise))
        for a, b in zip(keep_src, keep_dst, strict=True):
            np.testing.assert_array_equal(a, b)  # every byte moved, both ways
    finally:
        pre.close()
        dec.close()
    whole, each = statistics.median(times[False]), statistics.median(times[True])
    nbytes = sum(a.nbytes for a in keep_src)
    return {
        "driver": driver,
        "layers": layers,
        "mib": nbytes / 2**20,
        "compute_ms": compute_s * layers * 1e3,
        "whole_ms": whole * 1e3,
        "layerwise_ms": each * 1e3,
        "speedup": whole / each,
    }


def main() -> None:
    args = parser("layerwise", __doc__)
    args.add_argument("--drivers", default="loopback,mooncake,nixl")
    args.add_argument("--layers", type=int, default=16)
    args.add_argument("--pages", type=int, default=64)
    args.add_argument("--compute-ms", type=float, default=4.0)
    args.add_argument("--repeat", type=int, default=5)
    opts = args.parse_args()
    columns = [
        Column("driver", "driver", width=10),
        Column("MiB", "mib", ".1f", 8),
        Column("compute ms", "compute_ms", ".1f", 12),
        Column("whole ms", "whole_ms", ".1f", 10),
        Column("per layer ms", "layerwise_ms", ".1f", 14),
        Column("speedup", "speedup", ".2f", 9),
    ]
    print(header(columns))
    rows = []
    for driver in opts.drivers.split(","):
        row = run(driver, opts.pages, opts.layers, opts.compute_ms / 1e3, opts.repeat)
        print(line(row, columns), flush=True)
        rows.append(row)
    save(opts.out, rows, layers=opts.layers, pages=opts.pages, compute_ms=opts.compute_ms)


if __name__ == "__main__":
    main()
