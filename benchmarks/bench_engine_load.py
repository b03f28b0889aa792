"""An engine's load through real Sessions in real processes, on every driver, quiet and busy.

Each row is one ``xferkit bench`` case (``xferkit.bench.handoff.run_case``): prefill
and decode ranks as separate processes with Session defaults, ``--requests``
requests of random length (``--min-tokens``..``--tokens``) with ``--concurrency``
in flight, each in ``--chunks`` chunks plus its state slot, every byte checked
(``--verify 0``: none) and every decode slot audited after the last. ``busy``
rows run the same with ``--hogs`` processes spinning on the CPU, as an unrelated
job would, from the moment the ranks are up (their pools' first touch is not the
transfer, and took minutes under the hogs on a VM whose fresh memory comes slowly).
Each of ``--shapes`` (``PRESET[:LAYERS]``: the mock engine's tiny hybrid, Llama-70B's
KV heads of 128, Qwen3-Next's GDN state) gets its rows.
``one large`` rows move a single request of ``--large-tokens`` at a time,
without byte checks, so that the checker's hashing between requests does not
count as transfer time, on the same machine (quiet, or busy with the same hogs) as
the load rows after them: the aggregate under load over it is the ``vs 1 large``
column (with checks on, the load rows pay for theirs). A failed request ends its
row with the root cause (its stage first). Prints a table and writes
benchmarks/results/engine_load.json.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from report import Column, script

from xferkit.bench.errors import BenchError
from xferkit.bench.handoff import Case, Workload, run_case
from xferkit.bench.models import PRESETS, shaped

DRIVERS = ("loopback", "mooncake", "nixl")


def _spin() -> None:
    while True:
        pass


@contextmanager
def _busy(hogs: int) -> Iterator[Callable[[], None]]:
    """A call that starts ``hogs`` processes keeping the cores busy until the block ends."""
    procs: list[Any] = []

    def start() -> None:
        for _ in range(hogs):
            procs.append(mp.get_context("spawn").Process(target=_spin, daemon=True))
            procs[-1].start()

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.join()


def _case(
    driver: str, work: Workload, tp: tuple[int, int], machine: str, model: str, shape: str,
    hogs: int,
) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"driver": driver, "model": model, "shape": shape, "machine": machine}
    started = time.monotonic()
    try:
        with _busy(hogs if machine == "busy" else 0) as start:  # once the ranks are up
            result = run_case(Case(driver, tp), work, ready=start).to_json()
    except BenchError as exc:
        text = str(exc)
        return {**row, "done": 0, "failed": work.requests, "error": text,
                "wall_s": time.monotonic() - started}  # fmt: skip
    result.pop("records")
    return {
        **row, "done": result["requests"], "failed": 0, "error": "",
        "wall_s": time.monotonic() - started, **result,
    }  # fmt: skip


def run(
    shapes: str, tp: str, requests: int, concurrency: int, chunks: int, min_tokens: int,
    tokens: int, large_tokens: int, hogs: int, drivers: str, verify: int,
) -> list[dict[str, Any]]:  # fmt: skip
    pair = (int(tp.split(":")[0]), int(tp.split(":")[1]))
    rows = []
    for shape in shapes.split(","):
        name, _, layers = shape.partition(":")
        p = PRESETS[name]
        specs = shaped(p, int(layers or p.layers), (p.page, p.page), ("nhd", "nhd"))
        load = Workload(specs, tokens, (p.page, p.page), requests, concurrency, chunks,
                        min_tokens=min_tokens, verify=bool(verify))  # fmt: skip
        large = Workload(specs, large_tokens, (p.page, p.page), 3, 1, chunks, verify=False)
        for driver in drivers.split(","):
            for machine in ("quiet", "busy"):
                # Against one large request on the same machine: two hogs halve what the
                # ranks get of the cores, for the large request as for the load.
                one = _case(driver, large, pair, machine, shape, "one large", hogs)
                rows.append(one)
                what = f"{min_tokens}-{tokens} tokens"
                row = _case(driver, load, pair, machine, shape, what, hogs)
                if row["done"] and one["done"]:
                    row["vs_large"] = row["gbps"] / one["gbps"]
                rows.append(row)
    return rows


def _get(key: str, spec: str) -> Any:
    return lambda r: format(r[key], spec) if key in r else "-"


def _cpu_per_gb(r: dict[str, Any]) -> str:
    """Every rank's CPU seconds per GB the row moved (``xferkit.bench.cpu``)."""
    per = r.get("cpu_s_per_gb")
    return "-" if not per else f"{per['all']:.2f}"


def _staged(r: dict[str, Any]) -> str:
    if "staged_chunks" not in r:
        return "-"
    return f"{r['staged_chunks']}/{r['staged_chunks'] + r['direct_chunks']}"


COLUMNS = [
    Column("driver", "driver", width=9, left=True),
    Column("model", "model", width=12, left=True),
    Column("shape", "shape", width=16, left=True),
    Column("machine", "machine", width=7, left=True),
    Column("done", "done", width=6),
    Column("failed", "failed", width=7),
    Column("req/s", _get("requests_per_s", ".1f"), width=7),
    Column("GB/s", _get("gbps", ".3f"), width=7),
    Column("p50 ms", _get("p50_ms", ".0f"), width=8),
    Column("p99 ms", _get("p99_ms", ".0f"), width=8),
    Column("staged", _staged, width=10),
    Column("writes", _get("writes", "d"), width=7),
    Column("wait p99", _get("staging_wait_p99_ms", ".1f"), width=10),
    Column("vs 1 large", _get("vs_large", ".2f"), width=11),
    Column("CPU s/GB", _cpu_per_gb, width=9),
    Column(" error", lambda r: " " + r["error"][:60], width=61, left=True),
]


if __name__ == "__main__":
    script(
        "engine_load",
        __doc__,
        run,
        COLUMNS,
        {
            "shapes": ("tiny,llama70b:8,qwen3next:8", "PRESET[:LAYERS],... (xferkit bench's)"),
            "tp": ("2:4", "PREFILL:DECODE TP sizes"),
            "requests": (200, "requests per row"),
            "concurrency": (200, "requests in flight"),
            "chunks": (3, "prefill writes per request"),
            "min_tokens": (16, "shortest request"),
            "tokens": (1024, "longest request"),
            "large_tokens": (16384, "the one large request's length"),
            "hogs": (os.cpu_count() or 2, "CPU-spinning processes on busy rows"),
            "drivers": (",".join(DRIVERS), "comma-separated"),
            "verify": (1, "check every byte of the load rows (0: none, as bench --no-verify)"),
        },
    )
