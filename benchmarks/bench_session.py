"""The Session's cost over the transfer itself, across two processes.

The prefill rank runs in a child process (its Session, plus direct
``Backend.write`` of the same descriptors for the baseline); the decode rank
runs here. The layer set is one rank of a Llama-70B TP-8 deployment (80
layers, k and v, one KV head of 128, pages of 64 tokens, bf16: 160 regions,
16 KiB per page and region). Measured:

- latency: one-page requests one after another, ``expect`` -> DONE at the
  decode rank (prefill offered and wrote first), against the same descriptors
  written directly (``write().wait()`` in the prefill process); the difference
  is the control plane's cost. Also with CurveZMQ keys (the encryption's cost).
- rate: one-page requests pipelined in blocks through one pair, against the
  same writes pipelined directly.

Session and direct measurements alternate (``--rounds``), so drift and the
load of other processes on the machine hit both alike.
- big: an 8192-token request (128 pages, 20480 descriptors, 320 MiB) through
  a Session against the same descriptors written directly, alternating, per
  driver (loopback, mooncake over TCP, nixl over UCX host memory).

Prints a table and writes benchmarks/results/session.json. ``--drivers ''``
skips the big test; ``--no-curve`` the CurveZMQ row.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq
from report import Column, kv_manifest, parser, save, table, timed

import xferkit as xk
from xferkit.session import Session, SessionKeys, State

LAYERS, HEAD_DIM, PAGE, BF16 = 80, 128, 64, 2  # one KV head per rank (8 heads, TP 8)
TOKENS = 8192
BIG_PAGES = TOKENS // PAGE
DRIVERS = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}


def manifest(pool_pages: int, seed: int) -> tuple[xk.Manifest, list[np.ndarray]]:
    """One KV head per rank (the heads of TP 8), as a TP-1 rank: one pair, equal layouts."""
    m, arrays = kv_manifest("NHD", 8, 0, LAYERS, pool_pages, seed)
    return xk.Manifest.build(m.regions, tp_rank=0, tp_size=1), arrays


def _keys(spec: tuple[bytes, bytes] | None) -> SessionKeys | None:
    return None if spec is None else SessionKeys(spec[0], spec[1], [spec[0]])


# -- the prefill process --------------------------------------------------------------


def prefill(conn: Connection) -> None:
    logging.basicConfig(level=logging.ERROR)
    driver, options, pool, keys = conn.recv()
    m, arrays = manifest(pool, seed=1)
    session = Session(xk.open_backend(driver, **options), m, keys=_keys(keys))
    conn.send(session.address)
    peer: xk.Peer | None = None
    p: xk.Plan | None = None
    sends = []
    while True:
        cmd = conn.recv()
        kind = cmd[0]
        if kind == "quit":
            break
        if kind == "connect":  # for direct writes: the decode rank's endpoint and manifest
            dst = xk.Manifest.decode(cmd[2])
            peer = session.backend.connect(cmd[1], dst)
            p = xk.plan(m, dst)
            conn.send(True)
        elif kind == "offer":  # prefill first: offer and write every request named
            _, rids, src = cmd
            for rid in rids:
                s = session.offer(rid)
                s.write({"kv": src}, last=True)
                sends.append(s)
            conn.send(True)
        elif kind == "reap":  # wait for the sends of finished requests
            for s in sends:
                assert s.wait(60) is State.DONE
            sends.clear()
            session.progress()
            conn.send(True)
        elif kind == "direct":  # the same descriptors, written directly: latency per write
            _, src, dst_slots, repeat, pipelined = cmd
            assert p is not None and peer is not None
            descs = p.expand({"kv": (src, dst_slots)})
            backend, to = session.backend, peer
            backend.write(to, descs).wait(60)  # warm
            # Pipelined: one timing of ``repeat`` writes in flight; else ``repeat`` timings.
            writes = functools.partial(_writes, backend, to, descs, repeat if pipelined else 1)
            conn.send(list(timed(writes, 1 if pipelined else repeat)))
    if peer is not None:
        session.backend.disconnect(peer)
    session.close()
    del arrays


def _writes(b: xk.Backend, peer: xk.Peer, descs: xk.Descriptors, count: int) -> None:
    """``count`` writes in flight at once, to done."""
    for w in [b.write(peer, descs) for _ in range(count)]:
        w.wait(60)


# -- the decode process (this one) -------------------------------------------------------


class Pair:
    def __init__(self, driver: str, pool: int, keys: tuple[bytes, bytes] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill, args=(child,), daemon=True)
        self.proc.start()
        self.conn.send((driver, DRIVERS[driver], pool, keys))
        self.manifest, self.arrays = manifest(pool, seed=2)
        self.session = Session(
            xk.open_backend(driver, **DRIVERS[driver]), self.manifest, keys=_keys(keys)
        )
        self.source = self.conn.recv()
        self.ask("connect", self.session.backend.endpoint(), self.manifest.encode())
        self.n = 0

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def rids(self, count: int) -> list[str]:
        out = [f"r{self.n + i}" for i in range(count)]
        self.n += count
        return out

    def one_by_one(
        self, count: int, src: list[int], dst: list[int], block: int = 20
    ) -> list[float]:
        """expect -> DONE per request, prefill having offered and written first."""
        out: list[float] = []
        while len(out) < count:
            rids = self.rids(block)
            self.ask("offer", rids, src)
            for rid in rids:
                t = time.perf_counter()
                state = self.session.expect(rid, self.source, {"kv": dst}).wait(60)
                out.append(time.perf_counter() - t)
                assert state is State.DONE
            self.ask("reap")
        self.session.progress()
        return out[:count]

    def pipelined(
        self, count: int, src: list[int], dst: list[int], block: int
    ) -> tuple[int, float]:
        """(requests, seconds): ``block`` in flight at a time (all into the same slots)."""
        took = 0.0
        done = 0
        while done < count:
            rids = self.rids(block)
            self.ask("offer", rids, src)
            t = time.perf_counter()
            recvs = [self.session.expect(rid, self.source, {"kv": dst}) for rid in rids]
            for r in recvs:
                assert r.wait(60) is State.DONE
            took += time.perf_counter() - t
            done += block
            self.ask("reap")
        self.session.progress()
        return done, took

    def close(self) -> None:
        self.conn.send(("quit",))
        self.proc.join(30)
        self.session.close()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def latency(
    driver: str, count: int, keys: tuple[bytes, bytes] | None, rounds: int
) -> dict[str, Any]:
    pair = Pair(driver, 8, keys)
    per = max(count // rounds, 1)
    session: list[float] = []
    direct: list[float] = []
    took = direct_took = 0.0
    done = direct_done = 0
    try:
        pair.one_by_one(50, [1], [2])  # warm: handshake, first plans
        for _ in range(rounds):  # alternating, so drift hits both alike
            session += pair.one_by_one(per, [1], [2])
            direct += pair.ask("direct", [1], [2], per, False)
        for _ in range(rounds):
            n, t = pair.pipelined(per * 4, [1], [2], block=64)
            done, took = done + n, took + t
            direct_took += pair.ask("direct", [1], [2], per * 4, True)[0]
            direct_done += per * 4
    finally:
        pair.close()
    rate, direct_rate = done / took, direct_done / direct_took
    base = statistics.median(direct)
    extra = [s - base for s in session]
    return {
        "test": "one page",
        "driver": driver,
        "keys": keys is not None,
        "requests": count,
        "session_median_ms": statistics.median(session) * 1e3,
        "session_p99_ms": _pct(session, 99) * 1e3,
        "direct_median_ms": base * 1e3,
        "direct_p99_ms": _pct(direct, 99) * 1e3,
        "control_median_ms": statistics.median(extra) * 1e3,
        "control_p99_ms": _pct(extra, 99) * 1e3,
        "session_req_s": rate,
        "direct_req_s": direct_rate,
    }


def big(driver: str, repeat: int) -> dict[str, Any]:
    pair = Pair(driver, BIG_PAGES)
    src = list(range(BIG_PAGES))
    dst = [(37 * i) % BIG_PAGES for i in range(BIG_PAGES)]  # scattered pages
    try:
        pair.one_by_one(1, src, dst, block=1)  # warm
        pair.ask("direct", src, dst, 1, False)
        session, direct = [], []
        for _ in range(repeat):  # alternating, so drift hits both alike
            session += pair.one_by_one(1, src, dst, block=1)
            direct += pair.ask("direct", src, dst, 1, False)
    finally:
        pair.close()
    nbytes = BIG_PAGES * LAYERS * 2 * PAGE * HEAD_DIM * BF16
    s, d = statistics.median(session), statistics.median(direct)
    return {
        "test": "llama70b 8192 tokens",
        "driver": driver,
        "descriptors": BIG_PAGES * LAYERS * 2,
        "mib": nbytes / 2**20,
        "session_s": session,
        "direct_s": direct,
        "session_gbps": nbytes / s / 1e9,
        "direct_gbps": nbytes / d / 1e9,
        "ratio": d / s,
    }


LATENCY = [
    Column(
        "one page (160 descs, 2.5 MiB)",
        lambda r: r["driver"] + (" + curve" if r["keys"] else ""),
        width=32,
        left=True,
    ),
    Column("median ms", "session_median_ms", ".3f"),
    Column("p99 ms", "session_p99_ms", ".3f", 8),
    Column("direct ms", "direct_median_ms", ".3f"),
    Column("ctl med", "control_median_ms", ".3f", 8),
    Column("ctl p99", "control_p99_ms", ".3f", 8),
    Column("req/s", "session_req_s", ".0f", 8),
    Column("direct/s", "direct_req_s", ".0f", 9),
]
BIG = [
    Column("8192 tokens", "driver", width=12, left=True),
    Column("descs", "descriptors", width=8),
    Column("MiB", "mib", ".0f", 6),
    Column("session GB/s", "session_gbps", ".2f", 14),
    Column("direct GB/s", "direct_gbps", ".2f", 13),
    Column("ratio", "ratio", ".3f", 7),
]


def main() -> None:
    args = parser("session", __doc__)
    args.add_argument("--requests", type=int, default=500)
    args.add_argument("--repeat", type=int, default=5)
    args.add_argument(
        "--rounds", type=int, default=10, help="session and direct alternate this many times"
    )
    args.add_argument(
        "--drivers", default=",".join(DRIVERS), help="drivers of the big test ('': skip it)"
    )
    args.add_argument("--no-curve", action="store_true", help="skip the CurveZMQ row")
    a = args.parse_args()
    logging.basicConfig(level=logging.ERROR)
    public, secret = zmq.curve_keypair()
    rows = [latency("loopback", a.requests, None, a.rounds)]
    if not a.no_curve:
        rows.append(latency("loopback", a.requests, (public, secret), a.rounds))
    table(rows, LATENCY)
    enc = None
    if len(rows) > 1:
        enc = rows[1]["session_median_ms"] - rows[0]["session_median_ms"]
        print(f"CurveZMQ cost per request (median latency with keys - without): {enc:.3f} ms")
    bigs = [big(d, a.repeat) for d in a.drivers.split(",") if d]
    if bigs:
        print()
        table(bigs, BIG)
    save(
        a.out,
        rows + bigs,
        requests=a.requests,
        rounds=a.rounds,
        repeat=a.repeat,
        curve_ms=enc,
    )


if __name__ == "__main__":
    main()
