"""CPU each request costs every process of a deployment, apart from its bytes, per driver.

An engine pays for a request's handoff twice: in bytes moved, and in the CPU its ranks
spend on the request whatever its size (messages, plans, rounds, posts, completions).
Each row runs one ``xferkit bench`` case (``run_case``: prefill and decode ranks as
processes with Session defaults, ``--concurrency`` requests in flight, ``--chunks``
chunks plus the state slot, no byte checks) with ``--tokens``-token requests twice,
``--requests`` and six times as many, and reads each process's CPU (user and system,
``/proc``) from the moment its ranks are up to the last request's end. The difference
over the extra requests is the CPU one request costs: per prefill rank and per decode
rank (the mean over ranks), split by thread: the rank's main thread (``engine``: the
bench's harness, what an engine's own thread calls, ``expect``, ``offer``, ``write``,
``wait``), the Session's control thread, data-plane worker and pack worker, ZMQ's I/O
threads, the bench rank's reporter, and the rest (``driver``: the driver's threads), read
by the names the Session's threads give themselves at the OS; and the coordinator's (the
bench's own). Beside them, the writes (driver posts) and staged chunks (chunk and decode
rank pairs) of a request, all ranks together. Prints a table and writes
benchmarks/results/request_cpu.json.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
from typing import Any

from report import Column, script

from xferkit.bench import cpu
from xferkit.bench.handoff import Case, Workload, run_case
from xferkit.bench.models import PRESETS, shaped
from xferkit.bench.record import summary


def _snapshot() -> dict[str, dict[str, float]]:
    """Rank name -> CPU seconds per kind of thread (``cpu.kinds_s``) and in all; the
    coordinator's under ''."""
    out = {"": {"all": time.process_time()}}
    for proc in mp.active_children():
        if proc.pid is not None and " rank " in proc.name:
            out[proc.name] = cpu.kinds_s([proc.pid]) or {}
    return out


def _measure(
    driver: str, work: Workload, tp: tuple[int, int]
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """CPU seconds per process and kind of thread from the ranks being up to the last
    request's end, and the run's summary (its writes and staged chunks)."""
    marks: list[dict[str, dict[str, float]]] = []
    ended = 0

    def tick() -> None:
        nonlocal ended
        ended += 1
        if ended == work.requests:
            marks.append(_snapshot())

    result = run_case(Case(driver, tp), work, tick=tick, ready=lambda: marks.append(_snapshot()))
    first, last = marks
    used = {name: {k: v - first[name].get(k, 0.0) for k, v in last[name].items()} for name in first}
    return used, summary(result.measured)


def run(
    drivers: str, preset: str, layers: int, tp: str, tokens: int, requests: int,
    concurrency: int, chunks: int,
) -> list[dict[str, Any]]:  # fmt: skip
    pair = (int(tp.split(":")[0]), int(tp.split(":")[1]))
    p = PRESETS[preset]
    specs = shaped(p, layers or p.layers, (p.page, p.page), ("nhd", "nhd"))
    rows = []
    for driver in drivers.split(","):
        (few, _), (many, done) = (
            _measure(
                driver,
                Workload(specs, tokens, (p.page, p.page), n, concurrency, chunks, verify=False),
                pair,
            )
            for n in (requests, 6 * requests)
        )
        extra = 5 * requests
        for role in ("prefill", "decode", "coordinator"):
            names = [n for n in few if (n.startswith(role) if n else role == "coordinator")]

            per_request = functools.partial(_per_request, few, many, names, extra)
            row: dict[str, Any] = {
                "driver": driver,
                "process": role if role == "coordinator" else f"{role} rank (mean)",
                "ranks": len(names) if role != "coordinator" else 1,
                "ms_per_request": per_request("all"),
                "writes_per_request": done["writes"] / done["requests"],
                "staged_per_request": done["staged_chunks"] / done["requests"],
                "tokens": tokens,
                "requests": (requests, 6 * requests),
            }
            if role != "coordinator":
                row |= {f"{kind}_ms": per_request(kind) for _, kind in cpu.KINDS}
                row["driver_ms"] = per_request("driver")
            rows.append(row)
    return rows


def _per_request(
    few: dict[str, dict[str, float]], many: dict[str, dict[str, float]], names: list[str],
    extra: int, kind: str,
) -> float:  # fmt: skip
    """ms of ``kind`` per extra request, the mean over the ranks ``names``."""
    more = sum(many[n].get(kind, 0.0) - few[n].get(kind, 0.0) for n in names)
    return more / len(names) / extra * 1e3


def _ms(key: str) -> Any:
    return lambda r: f"{r[key]:.2f}" if key in r else "-"


COLUMNS = [
    Column("driver", "driver", width=9, left=True),
    Column("process", "process", width=20, left=True),
    Column("ranks", "ranks", "d", 6),
    Column("CPU ms/req", "ms_per_request", ".2f", 11),
    Column("engine", _ms("engine_ms"), width=7),
    Column("control", _ms("control_ms"), width=8),
    Column("data", _ms("data_ms"), width=6),
    Column("pack", _ms("pack_ms"), width=6),
    Column("driver", _ms("driver_ms"), width=7),
    Column("zmq", _ms("zmq_ms"), width=6),
    Column("bench", _ms("bench_ms"), width=6),
    Column("writes/req", "writes_per_request", ".1f", 11),
    Column("staged/req", "staged_per_request", ".1f", 11),
]


if __name__ == "__main__":
    script(
        "request_cpu",
        __doc__,
        run,
        COLUMNS,
        {
            "drivers": ("loopback,mooncake,nixl", "comma-separated"),
            "preset": ("llama70b", None),
            "layers": (8, "0: the preset's"),
            "tp": ("2:4", "PREFILL:DECODE TP sizes"),
            "tokens": (16, "tokens per request: small, so that the bytes cost little"),
            "requests": (200, "the smaller run's requests (the larger runs six times as many)"),
            "concurrency": (200, "requests in flight"),
            "chunks": (3, "prefill writes per request"),
        },
    )
