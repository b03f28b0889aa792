"""Where the CPU of pipelined one-page requests goes, thread by thread, in both processes.

``bench_session.py``'s pair (a prefill process, this decode process, the loopback) runs
``--requests`` one-page requests, ``--inflight`` at a time, after a warm-up. Each thread's
user and system time over that run comes from ``/proc/<pid>/task/<tid>/stat``, per request,
named by its Python thread name (the prefill process says its own) or, for a thread Python
did not start (libzmq's I/O thread), by its kernel name. CPU time is steadier than a rate on
a shared machine: a run measures what each thread costs, not how the machine felt. Only the
pair's public calls are used, so the same script measures older code (``PYTHONPATH`` naming
its SDK and loopback plugin first), side by side.

Prints a table and writes benchmarks/results/threads.json.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import bench_session
from report import Column, parser, save, table

import xferkit

TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")

ROLES = [
    (r"^xferkit-session-", "control thread"),
    (r"^xferkit-data-", "data-plane worker"),
    (r"^xferkit-loopback-.*-rx$", "loopback notice receiver"),
    (r"^xferkit-loopback-", "loopback copy worker"),
    (r"^xferkit-pack", "pack worker"),
    (r"^MainThread$", "engine thread"),
    (r"^ZMQbg/", "libzmq I/O thread"),
]


def role(name: str) -> str:
    return next((r for pattern, r in ROLES if re.search(pattern, name)), name)


def cpu(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (kernel name, user ticks, system ticks) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # it ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, int(fields[11]), int(fields[12]))
    return out


def names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class _Answering:
    """The child's end of the pipe, answering ``("threads",)`` itself (bench_session's loop
    does not know it)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self) -> Any:
        while True:
            cmd = self.conn.recv()
            if cmd != ("threads",):
                return cmd
            self.conn.send(names())

    def send(self, obj: Any) -> None:
        self.conn.send(obj)


def prefill(conn: Connection) -> None:
    bench_session.prefill(_Answering(conn))  # type: ignore[arg-type]


def run(requests: int, inflight: int) -> tuple[list[dict[str, Any]], float]:
    bench_session.prefill = prefill  # the pair's child process runs this one
    pair = bench_session.Pair("loopback", 8)
    try:
        pair.one_by_one(50, [1], [2])
        pair.pipelined(10 * inflight, [1], [2], block=inflight)  # warm: plans, handshake
        child = pair.proc.pid
        assert child is not None
        pids = {"decode": os.getpid(), "prefill": child}
        before = {side: cpu(pid) for side, pid in pids.items()}
        done, took = pair.pipelined(requests, [1], [2], block=inflight)
        after = {side: cpu(pid) for side, pid in pids.items()}
        told = {"decode": names(), "prefill": pair.ask("threads")}
    finally:
        pair.close()
    rows: list[dict[str, Any]] = []
    for side in ("prefill", "decode"):
        per: dict[str, list[float]] = {}
        for tid, (kernel, user, system) in after[side].items():
            name = role(told[side].get(tid, kernel))
            _, user0, system0 = before[side].get(tid, (kernel, 0, 0))
            got = per.setdefault(name, [0.0, 0.0])
            got[0] += (user - user0) * TICK_US / done
            got[1] += (system - system0) * TICK_US / done
        for name, (user_us, system_us) in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            if user_us + system_us >= 0.5:
                rows.append(
                    {"side": side, "thread": name, "user_us": user_us, "system_us": system_us}
                )
        total = [sum(v[0] for v in per.values()), sum(v[1] for v in per.values())]
        rows.append({"side": side, "thread": "all", "user_us": total[0], "system_us": total[1]})
    return rows, done / took


def main() -> None:
    args = parser("threads", __doc__)
    args.add_argument("--requests", type=int, default=8000)
    args.add_argument("--inflight", type=int, default=64)
    a = args.parse_args()
    mp.set_start_method("spawn", force=True)
    began = time.monotonic()
    rows, rate = run(a.requests, a.inflight)
    table(rows, [Column("side", "side", width=8, left=True),
                 Column("thread", "thread", width=26, left=True),
                 Column("user us/req", "user_us", ".1f", 12),
                 Column("system us/req", "system_us", ".1f", 14)])  # fmt: skip
    print(f"{rate:,.0f} requests/s ({time.monotonic() - began:.0f} s in all)")
    save(a.out, rows, requests=a.requests, inflight=a.inflight, requests_per_s=rate,
         sdk=os.path.dirname(xferkit.__file__))  # fmt: skip


if __name__ == "__main__":
    main()
