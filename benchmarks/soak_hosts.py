"""A soak across hosts: P prefill and D decode ranks, random faults, every byte checked.

Each rank is its own process on its own host (a network namespace of
``xferkit.testing.hosts``; root needed), driven like the fault matrix's ranks
(tests/session/session_rank.py). Rounds of ``--inflight`` requests run back to back
for ``--seconds``: every request names fresh decode slots (1 to 8 KV pages of 128 KiB
and one state slot) on every decode rank and is written by every prefill rank
(TP P -> D). A fault hits about one round in ``--fault-every``, at a random moment
of it: a link cut, a link slowed to a crawl, a rank frozen (SIGSTOP) for 0.3-3 s,
or a prefill rank killed (restarted after the round). Then:

- a request DONE on every decode rank must hold the reference bytes (``Landed``);
- a request that failed has its slots reused at once (filled with a sentinel), and
  after a settling pause no byte may have landed in them (``late bytes``);
- the slots no request holds must keep the sentinel (``stray bytes``);
- every rank's RSS and open fds are sampled after each round.

Prints a table per window of ``--window`` seconds and writes
benchmarks/results/soak_hosts.json. Not a CI test: ten minutes by default.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import Column, parser, save, table

from xferkit.testing.hosts import Host, Hosts

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "session"))
from session_rank import (
    Expect,
    Fill,
    Forget,
    Landed,
    Offer,
    RankProcess,
    Setup,
    Stray,
    Wait,
    Write,
)

SESSION = {
    "heartbeat_s": 0.2,
    "dead_after_s": 1.0,
    "handshake_timeout_s": 3.0,
    "request_timeout_s": 4.0,
    "reconnect_min_s": 0.05,
    "reconnect_max_s": 0.2,
}
WAIT_S = 4.0 + 10.0 + 1.0 + 5.0  # request_timeout_s + the source's drain + dead_after_s, slack
LAYERS, PAGE = 16, 64  # 128 KiB per KV slot and rank
SLOTS = {"kv": 128, "state": 8}
SENTINEL = 0x5A
SETTLE_S = 0.5  # after a round with a failure: time for late bytes to land
FAULTS = ("cut", "crawl", "freeze-prefill", "freeze-decode", "kill-prefill")

Slots = dict[str, list[int]]


def _options(driver: str, host: Host) -> dict[str, Any]:
    return {"protocol": "tcp", "hostname": host.address} if driver == "mooncake" else {}


def _env(driver: str) -> dict[str, str] | None:
    if driver == "nixl":  # UCX over TCP on the link, not CMA across the namespaces
        return {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    return None


class Ranks:
    """The P prefill and D decode rank processes on their hosts (prefill on the first P)."""

    def __init__(self, box: Hosts, driver: str, p: int, d: int, staging: str) -> None:
        self.box, self.driver, self.p, self.d, self.staging = box, driver, p, d, staging
        self.pre = [self._start("src", i) for i in range(p)]
        self.dec = [self._start("dst", j) for j in range(d)]
        for r in self.pre + self.dec:
            self._ready(r)
        for r in self.dec:  # every free slot holds the sentinel
            r.ok(Fill({pool: list(range(n)) for pool, n in SLOTS.items()}, SENTINEL))
        self.restarts = 0

    def host(self, role: str, index: int) -> Host:
        return self.box[index if role == "src" else self.p + index]

    def _start(self, role: str, index: int) -> RankProcess:
        host = self.host(role, index)
        rank = RankProcess(host.prefix(), env=_env(self.driver))
        session = {**SESSION, "staging": self.staging}
        setup = Setup(
            role, index, self.p, self.d, self.driver, _options(self.driver, host),
            session=session, bind=f"tcp://{host.address}:0", layers=LAYERS, page=PAGE,
            slots=SLOTS,
        )  # fmt: skip
        rank.send(setup)
        return rank

    @staticmethod
    def _ready(rank: RankProcess) -> None:
        reply = rank.reply()
        if not reply.ok:
            raise RuntimeError(f"a rank did not start: {reply.error}")
        rank.address = reply.address

    def restart_prefill(self, index: int) -> None:
        self.pre[index].kill()
        self.pre[index] = self._start("src", index)
        self._ready(self.pre[index])
        self.restarts += 1

    def sources(self) -> list[str]:
        return [r.address for r in self.pre]

    def close(self) -> None:
        for r in self.pre + self.dec:
            if r.proc.poll() is None:
                os.kill(r.proc.pid, signal.SIGCONT)  # a fault may have left it stopped
            r.close()


def _usage(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open fds) of a process; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0


class Fault(threading.Thread):
    """One fault, started ``delay`` seconds into a round, undone ``length`` seconds later
    (a kill is not undone: the round's end restarts the rank)."""

    def __init__(self, ranks: Ranks, kind: str, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.kind, self.delay, self.length = kind, rng.uniform(0, 0.5), rng.uniform(0.3, 3.0)
        self.prefill = rng.randrange(ranks.p)
        self.decode = rng.randrange(ranks.d)
        self.ranks = ranks
        self.on, self.off = self._actions()
        self.start()

    def _actions(self) -> tuple[Callable[[], None], Callable[[], None]]:
        r, link = self.ranks, self.ranks.host("dst", self.decode)
        if self.kind == "cut":
            return link.cut, link.mend
        if self.kind == "crawl":
            return lambda: link.limit("8kbit", burst="2kb"), link.unlimit
        pid = (r.pre[self.prefill] if self.kind != "freeze-decode" else r.dec[self.decode]).proc.pid
        if self.kind == "kill-prefill":
            return lambda: os.kill(pid, signal.SIGKILL), lambda: None
        return lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT)

    def run(self) -> None:
        time.sleep(self.delay)
        try:
            self.on()
            time.sleep(self.length)
        finally:
            self.off()


def _round(
    ranks: Ranks, rng: random.Random, n: int, first: int, fault: Fault | None, out: Counter[str]
) -> bool:
    """``n`` requests in flight at once; their outcome counted in ``out``. True when one
    failed (its slots were reused at once and are checked for late bytes)."""
    free = {pool: rng.sample(range(count), count) for pool, count in SLOTS.items()}
    reqs: list[tuple[str, Slots, Slots]] = []
    for k in range(n):
        pages = rng.randint(1, 8)
        dst = {"kv": [free["kv"].pop() for _ in range(pages)], "state": [free["state"].pop()]}
        src = {pool: rng.sample(range(SLOTS[pool]), len(s)) for pool, s in dst.items()}
        reqs.append((f"q{first + k}", src, dst))
    dead: set[int] = set()

    def ask(rank: RankProcess, cmd: Any, who: int | None = None) -> Any:
        try:
            reply = rank.ask(cmd)
        except (RuntimeError, BrokenPipeError, OSError):  # a killed prefill rank
            if who is not None:
                dead.add(who)
            return None
        if not reply.ok:  # the Session refused the call: said, and counted
            out[f"refused: {type(cmd).__name__}: {reply.error}"] += 1
        return reply

    sources = ranks.sources()
    for rid, src, dst in reqs:
        for r in ranks.dec:
            ask(r, Expect(rid, sources, dst))
        for i, r in enumerate(ranks.pre):
            ask(r, Offer(rid), i)
            ask(r, Write(rid, src, last=True), i)
    failed: list[Slots] = []
    for rid, src, dst in reqs:
        states = [ask(r, Wait(rid, WAIT_S)) for r in ranks.dec]
        if all(s is not None and s.state == "DONE" for s in states):
            pairs = {pool: (src[pool], dst[pool]) for pool in dst}
            exact = all((x := r.ok(Landed(pairs))).count == x.total for r in ranks.dec)
            out["done" if exact else "done, wrong bytes"] += 1
            for r in ranks.dec:
                r.ok(Fill(dst, SENTINEL))  # freed: the engine reuses the slots
        else:
            stage = next((s.stage or s.state for s in states if s and s.state != "DONE"), "?")
            out[f"failed: {stage}"] += 1
            for r in ranks.dec:  # reused as soon as FAILED: nothing may land in them now
                r.ok(Fill(dst, SENTINEL))
            failed.append(dst)
        for i, r in enumerate(ranks.pre):
            if i not in dead:
                ask(r, Wait(rid, WAIT_S), i)
        for i, r in enumerate(ranks.pre + ranks.dec):  # ended: the engine lets go of it
            if i not in dead:
                ask(r, Forget(rid))
    if fault is not None:
        fault.join()
    for i in sorted(dead):
        ranks.restart_prefill(i)
    if failed:
        time.sleep(SETTLE_S)
        for dst in failed:
            out["late bytes"] += sum(r.ok(Stray(dst, SENTINEL)).count for r in ranks.dec)
    every = {pool: list(range(count)) for pool, count in SLOTS.items()}  # all free again
    out["stray bytes"] += sum(r.ok(Stray(every, SENTINEL)).count for r in ranks.dec)
    return bool(failed)


def soak(
    driver: str, seconds: float, prefill: int, decode: int, inflight: int, fault_every: int,
    window: float, staging: str, seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with Hosts(prefill + decode) as box:
        ranks = Ranks(box, driver, prefill, decode, staging)
        try:
            start = time.monotonic()
            total: Counter[str] = Counter()
            win: Counter[str] = Counter()
            faults: Counter[str] = Counter()
            win_start, sent = start, 0
            while (now := time.monotonic()) - start < seconds:
                fault = None
                if fault_every and rng.randrange(fault_every) == 0:
                    kind = rng.choice(FAULTS)
                    faults[kind] += 1
                    fault = Fault(ranks, kind, rng)
                _round(ranks, rng, inflight, sent, fault, win)
                sent += inflight
                now = time.monotonic()
                if now - win_start >= window or now - start >= seconds:
                    usage = [_usage(r.proc.pid) for r in ranks.pre + ranks.dec]
                    done = win["done"]
                    rows.append(
                        {
                            "t_s": round(now - start, 1),
                            "req_s": done / (now - win_start),
                            "done": done,
                            "failed": sum(v for k, v in win.items() if k.startswith("failed")),
                            "stages": {k: v for k, v in win.items() if k.startswith("failed")},
                            "refused": {k: v for k, v in win.items() if k.startswith("refused")},
                            "wrong": win["done, wrong bytes"],
                            "late": win["late bytes"],
                            "stray": win["stray bytes"],
                            "rss_mib": max(u[0] for u in usage) / 1024,
                            "fds": max(u[1] for u in usage),
                            "faults": dict(faults),
                        }
                    )
                    total.update(win)
                    win, faults, win_start = Counter(), Counter(), now
        finally:
            ranks.close()
    return rows


COLUMNS = [
    Column("t s", "t_s", ".0f", 6),
    Column("req/s", "req_s", ".1f", 7),
    Column("done", "done", "", 6),
    Column("failed", "failed", "", 7),
    Column("wrong", "wrong", "", 6),
    Column("late B", "late", "", 8),
    Column("stray B", "stray", "", 8),
    Column("max RSS MiB", "rss_mib", ".0f", 12),
    Column("max fds", "fds", "", 8),
]


def main() -> None:
    args = parser("soak_hosts", __doc__)
    args.add_argument("--driver", default="mooncake", choices=["mooncake", "nixl"])
    args.add_argument("--seconds", type=float, default=600.0)
    args.add_argument("--prefill", type=int, default=2)
    args.add_argument("--decode", type=int, default=2)
    args.add_argument("--inflight", type=int, default=4, help="requests a round (at most 8)")
    args.add_argument("--fault-every", type=int, default=20, help="one round in N (0: none)")
    args.add_argument("--window", type=float, default=60.0)
    args.add_argument("--staging", default="auto", choices=["auto", "never", "always"])
    args.add_argument("--seed", type=int, default=0)
    a = args.parse_args()
    if not 1 <= a.inflight <= SLOTS["state"]:
        args.error(f"--inflight: 1 to {SLOTS['state']} (one state slot each)")
    rows = soak(
        a.driver, a.seconds, a.prefill, a.decode, a.inflight, a.fault_every, a.window,
        a.staging, a.seed,
    )  # fmt: skip
    table(rows, COLUMNS)
    for row in rows:
        print(f"  {row['t_s']:.0f} s: faults {row['faults']}, failures {row['stages']}")
        for what, n in row["refused"].items():
            print(f"    {n} x {what}")
    save(a.out, rows, **{k: v for k, v in vars(a).items() if k != "out"})


if __name__ == "__main__":
    main()
