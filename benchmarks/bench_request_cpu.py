"""CPU each request costs every process of a deployment, apart from its bytes, per driver.

An engine pays for a request's handoff twice: in bytes moved, and in the CPU its ranks
spend on the request whatever its size (messages, plans, rounds, posts, completions).
Each row runs one ``xferkit bench`` case (``run_case``: prefill and decode ranks as
processes with Session defaults, ``--concurrency`` requests in flight, ``--chunks``
chunks plus the state slot, no byte checks) with ``--tokens``-token requests twice,
``--requests`` and six times as many, and reads each process's CPU (user and system,
``/proc``) from the moment its ranks are up to the last request's end. The difference
over the extra requests is the CPU one request costs: per prefill rank and per decode
rank (the mean over ranks), split into the rank's main thread (the bench's harness: what
an engine's own thread calls, ``expect``, ``offer``, ``write``, ``wait``) and every other
thread (the Session's and the driver's), and the coordinator's (the bench's own); beside
them, the writes (driver posts) and staged chunks (chunk and decode rank pairs) of a
request, all ranks together. Prints a table and writes benchmarks/results/request_cpu.json.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from report import Column, script

from xferkit.bench.handoff import Case, Workload, run_case
from xferkit.bench.models import PRESETS, shaped
from xferkit.bench.record import summary

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """User and system seconds of a process (every thread) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _snapshot() -> dict[str, tuple[float, float]]:
    """Rank name -> (all threads, main thread) CPU seconds; the coordinator's under ''."""
    out = {"": (time.process_time(), time.process_time())}
    for proc in mp.active_children():
        if proc.pid is not None and " rank " in proc.name:
            out[proc.name] = (_cpu_s(proc.pid), _cpu_s(proc.pid, proc.pid))
    return out


def _measure(
    driver: str, work: Workload, tp: tuple[int, int]
) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """CPU seconds per process from the ranks being up to the last request's end, and the
    run's summary (its writes and staged chunks)."""
    marks: list[dict[str, tuple[float, float]]] = []
    ended = 0

    def tick() -> None:
        nonlocal ended
        ended += 1
        if ended == work.requests:
            marks.append(_snapshot())

    result = run_case(Case(driver, tp), work, tick=tick, ready=lambda: marks.append(_snapshot()))
    first, last = marks
    cpu = {name: (last[name][0] - a, last[name][1] - m) for name, (a, m) in first.items()}
    return cpu, summary(result.measured)


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
            total = sum(many[n][0] - few[n][0] for n in names) / len(names) / extra
            main = sum(many[n][1] - few[n][1] for n in names) / len(names) / extra
            rows.append(
                {
                    "driver": driver,
                    "process": role if role == "coordinator" else f"{role} rank (mean)",
                    "ranks": len(names) if role != "coordinator" else 1,
                    "ms_per_request": total * 1e3,
                    "main_ms": main * 1e3 if role != "coordinator" else float("nan"),
                    "other_ms": (total - main) * 1e3 if role != "coordinator" else float("nan"),
                    "writes_per_request": done["writes"] / done["requests"],
                    "staged_per_request": done["staged_chunks"] / done["requests"],
                    "tokens": tokens,
                    "requests": (requests, 6 * requests),
                }
            )
    return rows


COLUMNS = [
    Column("driver", "driver", width=9, left=True),
    Column("process", "process", width=20, left=True),
    Column("ranks", "ranks", "d", 6),
    Column("CPU ms/req", "ms_per_request", ".2f", 12),
    Column("main thread", "main_ms", ".2f", 13),
    Column("other threads", "other_ms", ".2f", 15),
    Column("writes/req", "writes_per_request", ".1f", 12),
    Column("staged/req", "staged_per_request", ".1f", 12),
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
