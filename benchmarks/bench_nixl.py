"""The NIXL plugin against raw NIXL calls on the same descriptors, in one run, two processes.

A peer process (``xferkit.testing.peer``) is decode rank 0 of a model with one
region per descriptor size (4 KiB, 64 KiB and 1 MiB slots, ``--total-mib``
each); this process is prefill rank 0 and writes every slot to a shuffled
destination slot, the way a paged KV cache moves. For each size, three ways of
moving the same bytes alternate, their order rotating round by round:

* ``raw init``: Nx3 arrays from the descriptors, ``nixlXferDList``,
  ``initialize_xfer``, ``transfer``, polling ``check_xfer_state``, release (the
  calls the plugin makes);
* ``raw prep``: ``make_prepped_xfer`` on per-slot lists prepared once, with the
  indices precomputed: the best a hand-written caller that already holds slot
  indices can do (the plugin, given addresses, has no such path: a prepared-list
  path measured 3 to 4 times slower to post than ``initialize_xfer`` and went);
* ``plugin``: ``backend.write(peer, descs).wait()``, core guards included.

Raw NIXL runs on an agent of its own with the plugin's configuration (progress
thread, 1 ms poll delay). On one host UCX moves the bytes inside ``transfer()``
(process_vm_writev), so each write's time splits into the copy (inside
``transfer()``, the same UCX code for every way) and the overhead around it;
both are recorded. Throughput ratios are taken per round (each pair ran under
the same load) and their median reported, next to the ratio the overheads
imply at the median copy time, which the load on a shared machine disturbs
less. Posting cost per descriptor is measured apart: building one request, no
transfer. The bytes are checked against the reference model at the end.
Prints tables and writes benchmarks/results/nixl.json.
"""

from __future__ import annotations

import os
import statistics
import time

import msgspec
import numpy as np
from report import Column, kib, parser, save, table, timed

import xferkit as xk
from xferkit.testing.peer import Check, PeerProcess, Setup
from xferkit.testing.reference import Reference, RegionSpec
from xferkit_nixl import ucx_env
from xferkit_nixl.backend import NixlDriver
from xferkit_nixl.nixl_api import load, new_agent

SIZES = [4 << 10, 64 << 10, 1 << 20]
WAYS = ("raw init", "raw prep", "plugin")
DRAM = ("DRAM", 0)


class _Envelope(msgspec.Struct):
    """The part of xferkit's endpoint envelope read here: the driver's blob."""

    blob: msgspec.Raw


class _Target(msgspec.Struct):
    """The NIXL driver's blob: the peer agent's name and metadata, for the raw agent."""

    name: str
    metadata: bytes


def _specs() -> list[RegionSpec]:
    return [
        RegionSpec(pool=f"p{size}", name="buf", layer=0, shape=(size,), itemsize=1)
        for size in SIZES
    ]


def _rows(addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The Nx3 (address, length, device 0) array NIXL takes, filled the fastest way we know."""
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = 0
    return out


def _paired(raw: list[float], plugin: list[float]) -> float:
    """Median over rounds of raw time / plugin time: the plugin's share of raw throughput."""
    return statistics.median(r / p for r, p in zip(raw, plugin, strict=True))


class _Clock:
    """Time spent inside an agent's ``transfer()`` calls (where UCX copies on one host)."""

    def __init__(self, agent) -> None:
        self.inside = 0.0
        real = agent.transfer

        def transfer(handle, *args):
            t = time.perf_counter()
            try:
                return real(handle, *args)
            finally:
                self.inside += time.perf_counter() - t

        agent.transfer = transfer


class Bench:
    def __init__(self, total: int) -> None:
        self.total = total
        self.slots = {f"p{size}": total // size for size in SIZES}
        ucx_env.apply_defaults()
        self.api, self.bindings = load()
        ref = Reference(_specs(), src_tp=1, dst_tp=1, src_slots=self.slots, dst_slots=self.slots)
        self.ref = ref  # owns the source buffers: they must outlive every transfer
        self.local = ref.srcs[0].manifest
        self.proc = PeerProcess()
        self.plugin = xk.open_backend("nixl", agent_prefix="bench-plugin")
        driver = self.plugin.driver
        assert isinstance(driver, NixlDriver)
        self.driver = driver
        config = self.api.nixl_agent_config(backends=["UCX"])
        self.raw = new_agent(self.api, self.bindings, "bench-raw", config, 1000)
        self.clocks = {"raw": _Clock(self.raw), "plugin": _Clock(driver._agent)}
        self.requests: dict[str, tuple[list[int], list[int]]] = {}

    def connect(self) -> None:
        ready = self.proc.ask(
            Setup(
                backend="nixl",
                options={},
                specs=_specs(),
                src_tp=1,
                dst_tp=1,
                src_slots=self.slots,
                dst_slots=self.slots,
                role="dst",
                index=0,
            )
        )
        assert ready.ok, ready.error
        self.remote = xk.Manifest.decode(ready.manifest)
        env = msgspec.msgpack.decode(ready.endpoint, type=_Envelope)
        self.target = msgspec.msgpack.decode(env.blob, type=_Target)
        self.plugin.register(self.local)
        self.peer = self.plugin.connect(ready.endpoint, self.remote)
        self.raw.register_memory([(r.addr, r.nbytes, 0, "") for r in self.local.regions], "DRAM")
        self.raw.add_remote_agent(self.target.metadata)
        self.plan = xk.plan(self.local, self.remote)

    def check(self) -> None:
        reply = self.proc.ask(Check(slots=self.requests))
        assert reply.ok, f"bytes differ from the reference: {reply.error}"

    def close(self) -> None:
        self.proc.close()
        self.plugin.close()
        self.raw = None

    # -- one descriptor size -----------------------------------------------------------

    def _raw_lists(self, pool: str, size: int, n: int):
        offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
        sizes = np.full(n, size, np.uint64)
        key = (pool, "buf", 0, 0)
        ends = []
        for agent_name, region in (
            ("NIXL_INIT_AGENT", self.local.region(key)),
            (self.target.name, self.remote.region(key)),
        ):
            ends.append(
                self.raw.prep_xfer_dlist(agent_name, _rows(region.addr + offs, sizes), "DRAM")
            )
        return ends

    def case(self, size: int, rounds: int, rng: np.random.Generator) -> dict:
        pool, n = f"p{size}", self.total // size
        order = rng.permutation(n)
        self.requests[pool] = (list(range(n)), order.tolist())
        descs = self.plan.expand({pool: (np.arange(n), order)})
        raw, b = self.raw, self.bindings
        lp, rp = self._raw_lists(pool, size, n)
        lidx, ridx = np.arange(n, dtype=np.int32), order.astype(np.int32)

        def make_raw_init():
            return raw.initialize_xfer(
                "WRITE",
                b.nixlXferDList(b.DRAM_SEG, _rows(descs.src, descs.nbytes)),
                b.nixlXferDList(b.DRAM_SEG, _rows(descs.dst, descs.nbytes)),
                self.target.name,
            )

        def make_raw_prep():
            return raw.make_prepped_xfer("WRITE", lp, lidx, rp, ridx)

        def raw_move(make) -> None:
            h = make()
            state = raw.transfer(h)
            while state == "PROC":
                state = raw.check_xfer_state(h)
            h.release()
            if state != "DONE":
                raise RuntimeError(f"raw transfer ended {state}")

        plugin, peer = self.plugin, self.peer
        ways = {
            "raw init": (lambda: raw_move(make_raw_init), self.clocks["raw"]),
            "raw prep": (lambda: raw_move(make_raw_prep), self.clocks["raw"]),
            "plugin": (lambda: plugin.write(peer, descs).wait(60), self.clocks["plugin"]),
        }
        for fn, _ in ways.values():  # warm: connections, caches
            fn()
        times: dict[str, list[float]] = {k: [] for k in WAYS}
        inside: dict[str, list[float]] = {k: [] for k in WAYS}
        for r in range(rounds):
            for k in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
                fn, clock = ways[k]
                before = clock.inside
                times[k] += timed(fn)
                inside[k].append(clock.inside - before)

        # Posting cost: building one request, no transfer (the plugin's: its NIXL request).
        reps = max(20, min(400, 200_000 // n))
        driver, link = self.driver, self.driver._remotes[self.target.name]
        posts = {
            "raw init": make_raw_init,
            "raw prep": make_raw_prep,
            "plugin": lambda: driver._request(link, DRAM, DRAM, descs, b""),
            "core guards": lambda: plugin._check_descriptors(peer, descs),
        }
        cost = {k: timed(fn, reps, then=_release).median * 1e6 for k, fn in posts.items()}
        lp.release()
        rp.release()

        copy = statistics.median(x for k in WAYS for x in inside[k])
        over = {
            k: statistics.median(t - x for t, x in zip(times[k], inside[k], strict=True))
            for k in WAYS
        }
        slug = {k: k.replace(" ", "_") for k in (*WAYS, "core guards")}
        row: dict = {
            "descriptor_bytes": size,
            "descriptors": len(descs),
            "bytes": int(descs.total_bytes),
            "copy_ms_median": copy * 1e3,
        }
        row |= {f"{slug[k]}_gbps": self.total / statistics.median(times[k]) / 1e9 for k in WAYS}
        row |= {f"{slug[k]}_overhead_us": over[k] * 1e6 for k in WAYS}
        row |= {f"{slug[k]}_copy_ms": statistics.median(inside[k]) * 1e3 for k in WAYS}
        row |= {
            # Per round (both ran under the same load), then the median.
            "ratio_init": _paired(times["raw init"], times["plugin"]),
            "ratio_vs_best_raw": _paired(
                [min(a, c) for a, c in zip(times["raw init"], times["raw prep"], strict=True)],
                times["plugin"],
            ),
            # What the overheads imply at the median copy time.
            "ratio_init_from_overhead": (copy + over["raw init"]) / (copy + over["plugin"]),
        }
        row |= {f"post_us_per_desc_{slug[k]}": v / len(descs) for k, v in cost.items()}
        row |= {f"post_us_{slug[k]}": v for k, v in cost.items()}
        return row


def run(total_mib: int, rounds: int) -> list[dict]:
    bench = Bench(total_mib << 20)
    try:
        bench.connect()
        rng = np.random.default_rng(0)
        rows = [bench.case(size, rounds, rng) for size in SIZES]
        bench.check()
    finally:
        bench.close()
    return rows


def _release(handle: object) -> None:
    if handle is not None:
        handle.release()  # type: ignore[attr-defined]


SPEED = [
    Column("desc", kib("descriptor_bytes"), width=7),
    Column("count", "descriptors", width=7),
    Column("raw init GB/s", "raw_init_gbps", ".2f", 14),
    Column("raw prep GB/s", "raw_prep_gbps", ".2f", 14),
    Column("plugin GB/s", "plugin_gbps", ".2f", 12),
    Column("plugin/raw init", "ratio_init", ".2f", 16),
    Column("from overhead", "ratio_init_from_overhead", ".2f", 14),
    Column("plugin/best raw", "ratio_vs_best_raw", ".2f", 16),
]
OUTSIDE = [
    Column("desc", kib("descriptor_bytes"), width=7),
    Column("copy ms", "copy_ms_median", ".2f", 9),
    Column("raw init", "raw_init_overhead_us", ".1f", 9),
    Column("raw prep", "raw_prep_overhead_us", ".1f", 9),
    Column("plugin", "plugin_overhead_us", ".1f", 9),
]
POSTING = [
    Column("desc", kib("descriptor_bytes"), width=7),
    Column("count", "descriptors", width=7),
    Column("raw init", "post_us_per_desc_raw_init", ".4f", 9),
    Column("raw prep", "post_us_per_desc_raw_prep", ".4f", 9),
    Column("plugin", "post_us_per_desc_plugin", ".4f", 9),
    Column("guards", "post_us_per_desc_core_guards", ".4f", 9),
    Column(
        "per request: raw init / raw prep / plugin",
        lambda r: (
            f"{r['post_us_raw_init']:.1f} / {r['post_us_raw_prep']:.1f} / "
            f"{r['post_us_plugin']:.1f} us"
        ),
        width=44,
    ),
]


def _print(rows: list[dict], total_mib: int, rounds: int) -> None:
    print(
        f"{total_mib} MiB per write, {rounds} rounds, two processes, UCX on host memory "
        f"({os.cpu_count()} CPUs)\n"
    )
    table(rows, SPEED)
    print("\ntime per write outside UCX's copy (us; median copy time in ms)\n")
    table(rows, OUTSIDE)
    print("\nposting cost per descriptor: building one request, no transfer (us)\n")
    table(rows, POSTING)


def main() -> None:
    args = parser("nixl", __doc__)
    args.add_argument("--total-mib", type=int, default=64, help="bytes per write, MiB")
    args.add_argument("--rounds", type=int, default=41)
    a = args.parse_args()
    rows = run(a.total_mib, a.rounds)
    _print(rows, a.total_mib, a.rounds)
    print()
    save(a.out, rows, total_mib=a.total_mib, rounds=a.rounds)


if __name__ == "__main__":
    main()
