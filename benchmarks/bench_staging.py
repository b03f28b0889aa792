"""Staged against direct heterogeneous TP on NHD and HND pages, through Sessions, per driver.

One decode rank (this process) and every prefill rank it needs (one process
each: one for 4 -> 8, two for 8 -> 4) of a Llama-70B-shaped layer set: 8 KV
heads of 128, bf16, pages of 64 tokens, ``--layers`` layers of k and v. Each
request moves ``--tokens`` tokens on random pages into the decode rank; the
prefill ranks offered and wrote it first, so the time from ``expect`` to DONE
covers the Request message, expanding, packing, the wire, unpacking and the
completion. Best of ``--repeat``, the cases alternating so drift hits them
alike. Staged cases run with ``staging="auto"`` (the cost model picks the
route from the driver's ``descriptor_bytes``), direct ones with "never".

Route efficiency (``/ 1 desc``): each case's GB/s over that of a request of the same
size whose one region holds it in one slot (one descriptor), through the same Sessions,
in the same rounds.

Also measured per driver, raw (no Session), into a peer process: the cost of one wire
descriptor (many 64-byte descriptors against one large one), as the bytes it could have
moved: what ``Capabilities.descriptor_bytes`` declares; the large-copy bandwidth over the
copier's (packing one head of each row of pages in random order): ``Capabilities.copy_cost``;
and the driver's own ceiling for a paged request (``paged / 1 desc``: 16 MiB as 16 KiB pages
at random places, 8 -> 8 NHD's descriptors, against one 16 MiB descriptor), which no
direct route can pass.

Prints tables and writes benchmarks/results/staging.json.
"""

from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing as mp
import statistics
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from report import BF16, HEADS, PAGE, Column, kv_manifest, parser, save, table, timed

import xferkit as xk
from xferkit.copier import copy_pieces
from xferkit.session import Session, State

DIM = 128
DRIVERS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}
ONE = "one"
"""A layout of one region whose one slot holds a whole request: one descriptor moves it."""
CASES = [  # (label, src TP, dst TP, src layout / page, dst layout / page, staging)
    ("8 -> 8 NHD", 8, 8, ("NHD", PAGE), ("NHD", PAGE), "never"),
    ("8 -> 8 NHD auto", 8, 8, ("NHD", PAGE), ("NHD", PAGE), "auto"),
    ("4 -> 8 HND", 4, 8, ("HND", PAGE), ("HND", PAGE), "never"),
    ("4 -> 8 NHD direct", 4, 8, ("NHD", PAGE), ("NHD", PAGE), "never"),
    ("4 -> 8 NHD staged", 4, 8, ("NHD", PAGE), ("NHD", PAGE), "auto"),
    ("8 -> 4 NHD direct", 8, 4, ("NHD", PAGE), ("NHD", PAGE), "never"),
    ("8 -> 4 NHD staged", 8, 4, ("NHD", PAGE), ("NHD", PAGE), "auto"),
]
VIEWS = [  # layouts no contiguous-byte plan moves cheaply: --views
    ("4 -> 4 NHD", 4, 4, ("NHD", PAGE), ("NHD", PAGE), "never"),
    ("4 -> 4 NHD>HND direct", 4, 4, ("NHD", PAGE), ("HND", PAGE), "never"),
    ("4 -> 4 NHD>HND staged", 4, 4, ("NHD", PAGE), ("HND", PAGE), "auto"),
    ("4 -> 8 NHD>HND staged", 4, 8, ("NHD", PAGE), ("HND", PAGE), "auto"),
    ("8 -> 8 HND p16>p64", 8, 8, ("HND", 16), ("HND", PAGE), "auto"),
    ("8 -> 8 NHD p16>p64", 8, 8, ("NHD", 16), ("NHD", PAGE), "auto"),
    ("8 -> 8 HND p64>p16", 8, 8, ("HND", PAGE), ("HND", 16), "auto"),
    ("4 -> 8 NHD p16>HND p64", 4, 8, ("NHD", 16), ("HND", PAGE), "auto"),
    ("8 -> 4 HND p64>NHD p16", 8, 4, ("HND", PAGE), ("NHD", 16), "auto"),
]


BASELINES = {  # the one-descriptor request of each size the cases move (by decode TP)
    tp: (f"one descriptor, TP {tp}", tp, tp, (ONE, 0), (ONE, 0), "never") for tp in (8, 4)
}


def manifest(
    view: tuple[str, int], tp: int, rank: int, layers: int, tokens: int
) -> tuple[xk.Manifest, list[np.ndarray]]:
    layout, page = view
    if layout == ONE:  # two slots, each the bytes a decode rank of TP ``tp`` gets
        size = layers * 2 * (tokens // 2) * (HEADS // tp) * DIM * BF16
        a = np.random.default_rng(rank).integers(0, 256, 2 * size, dtype=np.uint8)
        region = xk.Region(
            pool="kv",
            name="k",
            layer=0,
            addr=a.ctypes.data,
            nbytes=a.nbytes,
            slot_shape=(size,),
            itemsize=1,
        )
        return xk.Manifest.build([region]), [a]
    return kv_manifest(layout, tp, rank, layers, tokens // page, seed=rank, page=page)


def prefill(conn: Connection) -> None:
    """A prefill rank: offers and writes every request it is told of (for decode rank 0, the
    only one there is: the sends stay open for the others until reaped)."""
    logging.basicConfig(level=logging.ERROR)
    driver, view, tp, rank, layers, tokens, session = conn.recv()
    m, arrays = manifest(view, tp, rank, layers, tokens)
    s = Session(xk.open_backend(driver, **DRIVERS[driver]), m, **session)
    conn.send(s.address)
    sends = []
    while (cmd := conn.recv())[0] != "quit":
        if cmd[0] == "offer":
            _, rid, src = cmd
            send = s.offer(rid)
            send.write({"kv": src}, last=True)
            sends.append(send)
            conn.send(True)
        elif cmd[0] == "reap":  # the other decode ranks never ask: end what they would read
            for send in sends:
                send.abort(60)
            sends.clear()
            s.progress()
            conn.send(True)
    s.close()
    del arrays


class Case:
    """Decode rank 0 here, the prefill ranks it needs in child processes."""

    def __init__(self, driver: str, case: tuple, a: Any) -> None:
        _, src_tp, dst_tp, src_view, dst_view, staging = case
        session = {"staging": staging, "staging_bytes": a.staging, "staging_slice_bytes": a.slice}
        # Pools twice the request, so that random pages scatter.
        self.m, self.arrays = manifest(dst_view, dst_tp, 0, a.layers, 2 * a.tokens)
        self.session = Session(xk.open_backend(driver, **DRIVERS[driver]), self.m, **session)
        needed = max(1, src_tp // dst_tp)  # decode rank 0 reads prefill ranks 0..needed-1
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.sources = [], [], []
        for rank in range(needed):
            conn, child = ctx.Pipe()
            p = ctx.Process(target=prefill, args=(child,), daemon=True)
            p.start()
            conn.send((driver, src_view, src_tp, rank, a.layers, 2 * a.tokens, session))
            self.conns.append(conn)
            self.procs.append(p)
        self.sources = [c.recv() for c in self.conns]
        self.src_pages, self.dst_pages = (
            a.tokens // (v[1] or a.tokens) for v in (src_view, dst_view)
        )
        self.bytes = a.layers * 2 * a.tokens * (HEADS // dst_tp) * DIM * BF16
        self.rng = np.random.default_rng(7)
        self.n = 0

    def run(self) -> float:
        """One request, expect -> DONE, the prefill ranks having offered and written first."""
        rid = f"r{self.n}"
        self.n += 1
        src = self.rng.permutation(2 * self.src_pages)[: self.src_pages].tolist()
        dst = self.rng.permutation(2 * self.dst_pages)[: self.dst_pages].tolist()
        for c in self.conns:
            c.send(("offer", rid, src))
        for c in self.conns:
            c.recv()
        states: list[State] = []
        (took,) = timed(
            lambda: self.session.expect(rid, self.sources, {"kv": dst}).wait(600),
            then=states.append,
        )
        assert states == [State.DONE]
        for c in self.conns:
            c.send(("reap",))
        for c in self.conns:
            c.recv()
        self.session.progress()
        return took

    def routes(self) -> list[str]:
        return sorted(
            {
                r.path
                for u in self.session._protocol.pairs.ups.values()
                if u.staged
                for r in u.staged.routes.values()
            }
            or {"direct"}
        )

    def why(self) -> str:
        """Why the first region pair went the way it did, as the plan says."""
        key = ("kv", "k", 0, 0)
        for u in self.session._protocol.pairs.ups.values():
            if u.staged is not None:
                return u.staged.routes[key].why
            if u.manifest is not None:
                note = xk.plan(u.manifest, self.m).describe(key)
                return "staging off" + (f"; {note}" if note else "")
        return ""

    def close(self) -> None:
        for c in self.conns:
            c.send(("quit",))
        for p in self.procs:
            p.join(30)
        self.session.close()


def _write(b: xk.Backend, peer: xk.Peer, d: xk.Descriptors) -> None:
    b.write(peer, d).wait(600)


def target(conn: Connection) -> None:
    """The raw writes' destination, in a process of its own as a peer's memory is (the
    loopback copies within a process with memcpy, across them with process_vm_writev)."""
    driver, size = conn.recv()
    dst = np.zeros(size, dtype=np.uint8)
    b = xk.open_backend(driver, **DRIVERS[driver])
    m = xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="d", layer=0)])
    b.register(m)
    conn.send((b.endpoint(), m, dst.ctypes.data))
    conn.recv()
    b.close()


def descriptor_cost(driver: str) -> dict[str, Any]:
    """Seconds per 64-byte descriptor and bytes/s of one large one: their product. And the
    driver's own ceiling for a paged request: 16 MiB as 16 KiB pages at random places (8 -> 8
    NHD's descriptors) against one 16 MiB descriptor."""
    big, small, n = 64 << 20, 64, 16384
    page, pages = 16 << 10, 1024
    src = np.ones(big, dtype=np.uint8)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    conn.send((driver, big))
    endpoint, dm, dst_addr = conn.recv()
    a = xk.open_backend(driver, **DRIVERS[driver])
    try:
        a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="s", layer=0)]))
        peer = a.connect(endpoint, dm)
        s0, d0 = np.uint64(src.ctypes.data), np.uint64(dst_addr)
        step = np.arange(n, dtype=np.uint64) * np.uint64(4096)  # one per page: nothing merges
        many = xk.Descriptors(s0 + step, d0 + step[::-1], np.full(n, small, np.uint64))
        one = xk.Descriptors(np.array([s0]), np.array([d0]), np.array([big], np.uint64))
        rng = np.random.default_rng(3)
        at = [
            rng.permutation(big // page)[:pages].astype(np.uint64) * np.uint64(page) for _ in "sd"
        ]
        paged = xk.Descriptors(s0 + at[0], d0 + at[1], np.full(pages, page, np.uint64))
        whole = xk.Descriptors(np.array([s0]), np.array([d0]), np.array([page * pages], np.uint64))
        t: dict[str, list[float]] = {"many": [], "one": [], "paged": [], "whole": []}
        for _ in range(5):  # alternating, so drift hits all alike
            for key, d in (("many", many), ("one", one), ("paged", paged), ("whole", whole)):
                t[key] += timed(functools.partial(_write, a, peer, d))
    finally:
        a.close()
        conn.send("quit")
        proc.join(30)
    per_desc = min(t["many"]) / n
    bw = big / min(t["one"])
    # The copier packing what a 4 -> 8 NHD request packs: of each page (64 rows of two heads,
    # 512 bytes a row) the first head's 256 bytes, pages in random order.
    order = np.random.default_rng(0).permutation(big // (64 * 512)).astype(np.uint64)
    rows = (order[:, None] * np.uint64(64) + np.arange(64, dtype=np.uint64)[None, :]).ravel()
    out = np.arange(rows.size, dtype=np.uint64) * np.uint64(256)
    into = np.empty(big // 2, dtype=np.uint8)
    pack = (s0 + rows * np.uint64(512), into.ctypes.data + out, np.full(rows.size, 256, np.uint64))
    copy_bw = big / 2 / timed(functools.partial(copy_pieces, *pack), 5).best
    return {
        "driver": driver,
        "us_per_descriptor": per_desc * 1e6,
        "gbps_large": bw / 1e9,
        "descriptor_bytes": int(per_desc * bw),
        "copier_gbps": copy_bw / 1e9,
        "copy_cost": bw / copy_bw,
        "gbps_paged": page * pages / min(t["paged"]) / 1e9,
        "gbps_whole": page * pages / min(t["whole"]) / 1e9,
        "paged_vs_one": min(t["whole"]) / min(t["paged"]),
    }


COSTS = [
    Column("driver", "driver", width=10, left=True),
    Column("us/desc", "us_per_descriptor", ".2f", 9),
    Column("GB/s large", "gbps_large", ".2f", 12),
    Column("descriptor_bytes", "descriptor_bytes", width=18),
    Column("copier GB/s", "copier_gbps", ".2f", 13),
    Column("copy_cost", "copy_cost", ".2f", 11),
    Column("GB/s paged", "gbps_paged", ".2f", 12),
    Column("GB/s 1 desc", "gbps_whole", ".2f", 13),
    Column("paged / 1 desc", "paged_vs_one", ".2f", 16),
]
SPEEDS = [
    Column("driver", "driver", width=10, left=True),
    Column("case", "case", width=26, left=True),
    Column("GB/s", "gbps", ".2f", 7),
    Column("/ 8->8", "vs_equal", ".2f", 8),
    Column("/ 1 desc", "vs_one", ".2f", 10),
    Column("  route", lambda r: "  " + ",".join(r["routes"]), left=True),
]


def main() -> None:
    args = parser("staging", __doc__)
    args.add_argument("--layers", type=int, default=8)
    args.add_argument("--tokens", type=int, default=4096)
    args.add_argument("--repeat", type=int, default=5)
    args.add_argument("--staging", type=int, default=64 << 20, help="bytes per Session")
    args.add_argument("--slice", type=int, default=16 << 20, help="bytes per slice")
    args.add_argument("--drivers", default=",".join(DRIVERS))
    args.add_argument(
        "--views",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also NHD <-> HND and pages of 16 <-> 64 tokens",
    )
    args.add_argument(
        "--only", default="", help="comma-separated substrings: run the cases naming one"
    )
    a = args.parse_args()
    chosen = CASES + (VIEWS if a.views else [])
    if a.only:
        # The first case is the equal-TP baseline every ratio is taken against: always kept.
        chosen = chosen[:1] + [c for c in chosen[1:] if any(o in c[0] for o in a.only.split(","))]
    # Route efficiency: each case against one descriptor of its size, in the same rounds.
    chosen += [BASELINES[tp] for tp in sorted({c[2] for c in chosen})]
    logging.basicConfig(level=logging.ERROR)
    drivers = a.drivers.split(",")
    costs = [descriptor_cost(d) for d in drivers]
    table(costs, COSTS)
    rows = []
    for driver in drivers:
        cases = [Case(driver, c, a) for c in chosen]
        try:
            for case in cases:
                case.run()  # warm: handshakes, plans, routes
            runs: list[list[float]] = [[] for _ in cases]
            for _ in range(a.repeat):
                for i, case in enumerate(cases):
                    runs[i].append(case.run())
            routes = [case.routes() for case in cases]
            whys = [case.why() for case in cases]
        finally:
            for case in cases:
                case.close()
        equal = cases[0].bytes / min(runs[0])
        one = {
            c[2]: case.bytes / min(rs)
            for c, case, rs in zip(chosen, cases, runs, strict=True)
            if c[3][0] == ONE
        }
        for case, (label, _, dst_tp, *_), rs, rt, why in zip(
            cases, chosen, runs, routes, whys, strict=True
        ):
            gbps = case.bytes / min(rs)
            rows.append(
                {
                    "driver": driver,
                    "case": label,
                    "bytes": case.bytes,
                    "seconds": rs,
                    "median_s": statistics.median(rs),
                    "gbps": gbps / 1e9,
                    "vs_equal": gbps / equal,
                    "vs_one": gbps / one[dst_tp],
                    "routes": rt,
                    "why": why,
                }
            )
    print()
    table(rows, SPEEDS)
    print("\nwhy (the plan's own words, first k region of the first driver):")
    for r in rows[: len(chosen)]:
        print(f"  {r['case']}: {r['why']}")
    save(a.out, rows, costs=costs, layers=a.layers, tokens=a.tokens, staging=a.staging)


if __name__ == "__main__":
    main()
