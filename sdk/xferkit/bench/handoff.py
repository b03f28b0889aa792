"""The coordinator: rank processes per case, requests through their Sessions, records.

Prefill and decode ranks each run in their own process (``rank.serve``), each
with its own Session and backend. The coordinator only passes addresses and
commands over pipes: expects to every decode rank, offers (and chunked
writes) to every prefill rank, up to ``concurrency`` requests in flight, each
on fresh random destination pages. Every rank reports its own timing; decode
ranks check every byte before their pages are reused.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from ..errors import XferError
from ..manifest import Manifest, key_label
from ..planner import Plan, plan
from ..session import SessionKeys
from ..testing.reference import RegionSpec
from . import cpu
from .errors import CHECK, DRIVER, FAILED, USAGE, BenchError
from .rank import RankSetup, serve
from .record import Record, summary
from .starting import wait_start

Slots = dict[str, list[int]]


@dataclass(frozen=True)
class Case:
    driver: str
    tp: tuple[int, int]
    pp: tuple[int, int] = (1, 1)
    staging: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        pp = f" pp {self.pp[0]}:{self.pp[1]}" if self.pp != (1, 1) else ""
        return f"{self.driver} tp {self.tp[0]}:{self.tp[1]}{pp} {self.staging}"


@dataclass(frozen=True)
class Workload:
    specs: list[RegionSpec]
    tokens: int
    pages: tuple[int, int]  # tokens per page, prefill and decode
    requests: int
    concurrency: int = 1
    chunks: int = 1
    verify: bool = True
    keys: bool = False
    debug: bool = False
    session: dict[str, Any] = field(default_factory=dict)
    min_tokens: int = 0  # > 0: each request's length is drawn from [min_tokens, tokens]

    @property
    def model_pages(self) -> int:
        return math.ceil(self.tokens / min(self.pages))

    def slot_counts(self, tokens: int | None = None) -> tuple[int, int]:
        """KV slots a request of ``tokens`` (the longest by default) names on the prefill and
        on the decode side."""
        lo = min(self.pages)
        n = math.ceil((tokens or self.tokens) / lo)
        return math.ceil(n / (self.pages[0] // lo)), math.ceil(n / (self.pages[1] // lo))

    def draw_tokens(self, rng: np.random.Generator) -> int:
        if not self.min_tokens:
            return self.tokens
        return int(rng.integers(self.min_tokens, self.tokens + 1))

    @property
    def pools(self) -> set[str]:
        return {s.pool for s in self.specs}


_START_ERRORS = {  # a rank that cannot start: the model's fault, or the driver's
    "ManifestError": USAGE,
    "PlanError": USAGE,
    "PluginError": DRIVER,
    "OptionError": DRIVER,
    "CapabilityError": DRIVER,
    "RegistrationError": DRIVER,
}


class _Proc:
    def __init__(self, name: str, conn: Connection, proc: Any) -> None:
        self.name, self.conn, self.proc = name, conn, proc
        self.address = ""
        self.manifest: Manifest | None = None
        self.dropped: list[tuple[Any, str]] = []

    @property
    def pools(self) -> set[str]:
        assert self.manifest is not None
        return set(self.manifest.pools)


def _split(slots: list[int], chunks: int, multiple: int) -> list[list[int]]:
    """``chunks`` runs of ``slots`` in order, each but the last a multiple of ``multiple``."""
    size = max(multiple, math.ceil(len(slots) / chunks / multiple) * multiple)
    parts = [slots[i : i + size] for i in range(0, len(slots), size)]
    return parts or [[]]


class Cluster:
    """Every rank of one case, started in parallel; ``close`` ends them all, whatever happened."""

    def __init__(
        self, case: Case, work: Workload, slots: tuple[dict[str, int], dict[str, int]]
    ) -> None:
        ctx = mp.get_context("spawn")
        keys = None
        if work.keys:
            k = SessionKeys.generate()
            keys = (k.public, k.secret)
        session = {"staging": case.staging, **work.session}
        self.prefill: list[_Proc] = []
        self.decode: list[_Proc] = []
        for role, tp, pp, counts, out in (
            ("prefill", case.tp[0], case.pp[0], slots[0], self.prefill),
            ("decode", case.tp[1], case.pp[1], slots[1], self.decode),
        ):
            for p in range(pp):
                for t in range(tp):
                    setup = RankSetup(
                        role, t, tp, p, pp, work.specs, counts, case.driver, case.options,
                        session, keys, work.verify, work.debug,
                    )  # fmt: skip
                    ours, theirs = ctx.Pipe()
                    name = f"{role} rank {p * tp + t}" + (f" (pp {p} tp {t})" if pp > 1 else "")
                    proc = ctx.Process(target=serve, args=(theirs, setup), daemon=True, name=name)
                    out.append(_Proc(name, ours, proc))
        try:
            for r in self.ranks:
                r.proc.start()
            for r in self.ranks:
                why = wait_start(r.conn, r.proc)
                if why is not None:
                    raise BenchError(FAILED, f"{r.name} {why}")
                msg = self._recv(r, 0.0)
                if msg[0] == "error":
                    kind = msg[1].partition(":")[0]
                    code = _START_ERRORS.get(kind, FAILED)
                    raise BenchError(code, f"{r.name} could not start: {msg[1]}", msg[2])
                _, r.address, encoded, r.dropped = msg
                r.manifest = Manifest.decode(encoded)
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> list[_Proc]:
        return self.prefill + self.decode

    def cpu_now(self) -> dict[str, dict[str, float]] | None:
        """CPU seconds so far of the prefill and of the decode ranks (each role's processes
        together), by kind of thread (``cpu.kinds_s``); None where they cannot be read."""
        prefill = cpu.kinds_s(r.proc.pid for r in self.prefill)
        decode = cpu.kinds_s(r.proc.pid for r in self.decode)
        return None if prefill is None or decode is None else {"prefill": prefill, "decode": decode}

    def _recv(self, r: _Proc, timeout: float) -> tuple:
        if not r.conn.poll(timeout):
            raise BenchError(FAILED, f"{r.name} did not answer within {timeout:.0f} s")
        try:
            return r.conn.recv()
        except (EOFError, OSError):
            raise BenchError(FAILED, f"{r.name} exited (code {r.proc.exitcode})") from None

    def close(self) -> None:
        """Ask every rank to quit (its Session closes), then stop whatever is left."""
        for r in self.ranks:
            try:
                if r.proc.is_alive():
                    r.conn.send(("quit",))
            except (OSError, ValueError, AssertionError):
                pass
        # One deadline for all (they quit side by side): 10 s to quit, 5 more once terminated,
        # then killed. Waited one after another, six stuck ranks took 90 s.
        started = [r.proc for r in self.ranks if r.proc.pid is not None]
        for stop, grace in ((None, 10.0), ("terminate", 5.0), ("kill", None)):
            for proc in started:
                if stop is not None and proc.is_alive():
                    getattr(proc, stop)()
            until = time.monotonic() + (grace or 0.0)
            for proc in started:
                proc.join(None if grace is None else max(until - time.monotonic(), 0.0))
        for r in self.ranks:
            r.conn.close()


@dataclass
class CaseResult:
    case: Case
    records: list[Record]
    readers: dict[str, list[str]]  # decode rank -> the prefill ranks that write into it
    dropped: list[str]
    ceiling: dict[str, float] = field(default_factory=dict)
    cpu_threads: dict[str, dict[str, float]] | None = None  # measured: role -> kind -> s

    @property
    def measured(self) -> list[Record]:
        return [r for r in self.records if not r.warmup]

    def to_json(self) -> dict[str, Any]:
        c = self.case
        s = summary(self.measured)
        threads = self.cpu_threads
        used = None if threads is None else {role: k["all"] for role, k in threads.items()}
        ratio = s["gbps"] / self.ceiling["driver_gbps"] if self.ceiling else None
        return {
            "label": c.label,
            "driver": c.driver,
            "options": c.options,
            "tp": list(c.tp),
            "pp": list(c.pp),
            "staging": c.staging,
            **s,
            "ceiling": self.ceiling,
            "ratio": ratio,
            "cpu_s": used,
            "cpu_s_per_gb": _per_gb(used, s["gbps"] * s["span_s"]),
            "cpu_threads_s": threads,
            "readers": self.readers,
            "dropped": self.dropped,
            "records": [r.to_json() for r in self.records],
        }


def _per_gb(used: dict[str, float] | None, gigabytes: float) -> dict[str, float] | None:
    """CPU seconds per GB moved, per role and for all ranks together."""
    if used is None or gigabytes <= 0:
        return None
    return {
        **{role: s / gigabytes for role, s in used.items()},
        "all": sum(used.values()) / gigabytes,
    }


class _Slots:
    """Free destination slots per pool, handed out in random order (pages scatter)."""

    def __init__(self, counts: dict[str, int], rng: np.random.Generator) -> None:
        self.free = {p: deque(rng.permutation(n).tolist()) for p, n in counts.items()}

    def take(self, pool: str, n: int) -> list[int]:
        return [self.free[pool].popleft() for _ in range(n)]

    def give(self, pool: str, slots: list[int]) -> None:
        self.free[pool].extend(slots)


def run_case(
    case: Case,
    work: Workload,
    tick: Callable[[], None] = lambda: None,
    seed: int = 0,
    ready: Callable[[], None] = lambda: None,
) -> CaseResult:
    """Start the case's ranks, run one warm-up request and ``work.requests`` measured ones.
    ``ready`` runs once every rank is up, before the warm-up: where a busy machine's load
    starts (the ranks' first touch of their pools took minutes here under it)."""
    n_src, n_dst = work.slot_counts()
    c = work.concurrency
    src_counts = {"kv": 2 * n_src, "state": 2}
    dst_counts = {"kv": 2 * c * n_dst, "state": 2 * c}
    pools = work.pools
    src_counts = {p: n for p, n in src_counts.items() if p in pools}
    dst_counts = {p: n for p, n in dst_counts.items() if p in pools}
    cluster = Cluster(case, work, (src_counts, dst_counts))
    try:
        ready()
        plans = _plans(cluster)
        runner = _Runner(cluster, work, plans, src_counts, dst_counts, seed)
        records = runner.run(tick)
        used = runner.cpu_used()
        readers = {
            d.name: [s.name for i, s in enumerate(cluster.prefill) if (i, j) in plans]
            for j, d in enumerate(cluster.decode)
        }
        dropped = sorted(
            {
                f"{r.name}: {key_label(tuple(key))} ({why})"
                for r in cluster.ranks
                for key, why in r.dropped
            }
        )
    finally:
        cluster.close()
    return CaseResult(case, records, readers, dropped, cpu_threads=used)


def _plans(cluster: Cluster) -> dict[tuple[int, int], Plan]:
    """The (prefill, decode) rank pairs that move something, planned as the Session plans them."""
    out = {}
    for i, s in enumerate(cluster.prefill):
        for j, d in enumerate(cluster.decode):
            assert s.manifest is not None and d.manifest is not None
            try:
                p = plan(s.manifest, d.manifest)
            except XferError as exc:
                raise BenchError(USAGE, f"{s.name} -> {d.name}: {exc}") from exc
            if not p.empty:
                out[(i, j)] = p
    return out


class _Runner:
    def __init__(
        self,
        cluster: Cluster,
        work: Workload,
        plans: dict[tuple[int, int], Plan],
        src_counts: dict[str, int],
        dst_counts: dict[str, int],
        seed: int,
    ) -> None:
        self.cluster, self.work, self.plans = cluster, work, plans
        self.rng = np.random.default_rng(seed)
        self.src_counts = src_counts
        self.free = _Slots(dst_counts, self.rng)
        self.sources = [r.address for r in cluster.prefill]
        self.pending: dict[str, tuple[Record, dict[str, list[int]], set[str]]] = {}
        self.sized: list[tuple[Record, dict[str, tuple[list[int], list[int]]]]] = []
        lo = min(work.pages)
        k = work.pages[1] // lo  # prefill pages per decode page: chunks must hold whole ones
        self.multiple = k if work.pages[1] > work.pages[0] else 1
        self._cpu: list[dict[str, dict[str, float]] | None] = []  # warm-up's end, last's

    def _issue(self, n: int, warmup: bool) -> None:
        work = self.work
        n_src, n_dst = work.slot_counts(work.draw_tokens(self.rng))
        rid = f"r{n}"
        request: dict[str, tuple[list[int], list[int]]] = {}
        for pool in self.src_counts:
            count = (n_src, n_dst) if pool == "kv" else (1, 1)
            src = self.rng.choice(self.src_counts[pool], count[0], replace=False).tolist()
            request[pool] = (src, self.free.take(pool, count[1]))
        record = Record(rid, 0, 0, warmup=warmup)
        self.sized.append((record, request))  # sized after the run: planning here took the
        # cores from the ranks while they moved the load (40 of 101 ms a GB of the NIXL load)
        chunks: list[Slots] = (
            [{"kv": part} for part in _split(request["kv"][0], work.chunks, self.multiple)]
            if "kv" in request
            else [{}]
        )
        if "state" in request:
            chunks[-1]["state"] = request["state"][0]
        waiting = set()
        for r in self.cluster.decode:
            mine = {p: v for p, v in request.items() if p in r.pools}
            r.conn.send(("expect", rid, self.sources, {p: v[1] for p, v in mine.items()}, mine))
            waiting.add(r.name)
        for r in self.cluster.prefill:
            own = [{p: v for p, v in ch.items() if p in r.pools} for ch in chunks]
            own = [ch for ch in own[:-1] if ch] + [own[-1]]
            r.conn.send(("offer", rid, own))
            waiting.add(r.name)
        self.pending[rid] = (record, {p: v[1] for p, v in request.items()}, waiting)

    def run(self, tick: Callable[[], None]) -> list[Record]:
        work = self.work
        by_conn = {r.conn: r for r in self.cluster.ranks}
        decode = {r.name for r in self.cluster.decode}
        total = work.requests + 1  # the first warms up: handshakes, plans, routes
        issued = 0
        records: list[Record] = []
        self._issue(issued, warmup=True)
        issued += 1
        timeout = float(work.session.get("request_timeout_s", 60.0)) + 60.0
        while len(records) < total:
            if len(records) == 1 and not self._cpu:  # warmed up: the measured window opens
                self._cpu.append(self.cluster.cpu_now())
            if len(records) >= 1:
                while issued < total and len(self.pending) < work.concurrency:
                    self._issue(issued, warmup=False)
                    issued += 1
            ready = wait(list(by_conn), timeout)
            if not ready:
                raise BenchError(FAILED, f"no rank reported for {timeout:.0f} s")
            for conn in ready:
                r = by_conn[conn]  # type: ignore[index]
                try:
                    msg = r.conn.recv()
                except (EOFError, OSError):
                    raise BenchError(FAILED, f"{r.name} exited (code {r.proc.exitcode})") from None
                if msg[0] == "error":  # the rank's reporter broke
                    raise BenchError(FAILED, f"{r.name}: {msg[1]}", msg[2])
                if msg[0] != "done":
                    continue
                _, rid, start, end, error, verified, routes, times, spans = msg
                rid = str(rid)
                record, dst, waiting = self.pending[rid]
                if error:
                    raise BenchError(FAILED, f"request {rid} failed on {r.name}: {error}")
                if isinstance(verified, str):
                    raise BenchError(CHECK, f"request {rid}: {r.name}: {verified}")
                (record.decode if r.name in decode else record.prefill).append((start, end))
                record.route(*routes)
                record.timeline(spans)
                if r.name in decode:
                    record.times(times)
                if r.name in decode and verified is True:
                    record.verified = record.verified is not False
                waiting.discard(r.name)
                if not waiting:
                    del self.pending[rid]
                    for pool, slots in dst.items():
                        self.free.give(pool, slots)
                    records.append(record)
                    if not record.warmup:
                        tick()
        self._cpu.append(self.cluster.cpu_now())
        if work.verify:
            self._audit(timeout)
        for record, request in self.sized:
            for (_, j), p in self.plans.items():
                mine = {pl: v for pl, v in request.items() if pl in self.cluster.decode[j].pools}
                d = p.expand(mine)
                record.descriptors += len(d)
                record.bytes += d.total_bytes
        return records

    def cpu_used(self) -> dict[str, dict[str, float]] | None:
        """CPU seconds the measured requests cost each role by kind of thread (from the
        warm-up's end to the last request's), None where it could not be read."""
        if len(self._cpu) != 2:
            return None
        first, last = self._cpu
        if first is None or last is None:
            return None
        return {
            role: {kind: last[role][kind] - was for kind, was in kinds.items()}
            for role, kinds in first.items()
        }

    def _audit(self, timeout: float) -> None:
        """Every decode slot is free again, and zero (each checked request's were reset): a
        byte that landed in a slot after its request ended, or outside any, shows here."""
        for r in self.cluster.decode:
            r.conn.send(("audit",))
        for r in self.cluster.decode:
            if not r.conn.poll(timeout):
                raise BenchError(FAILED, f"{r.name} did not answer the audit in {timeout:.0f} s")
            _, problem = r.conn.recv()
            if problem:
                raise BenchError(CHECK, f"{r.name}: {problem}")
