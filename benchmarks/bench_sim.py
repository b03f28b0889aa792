"""The simulator's speed and power: schedules and simulated seconds per wall second for each
configuration of the CI budget (side by side, one run), then each defect put back into the
protocol core (xferkit.testing.sim.mutations) with the schedules it took to be found.

Prints two tables and writes benchmarks/results/sim.json.
Run: `python benchmarks/bench_sim.py` (`--seeds`: per configuration; `--budget`: per defect).
"""

from __future__ import annotations

import time
from typing import Any

from report import Column, parser, save, table

from xferkit.testing.sim import run
from xferkit.testing.sim.mutations import MUTATIONS, OUTSIDE, hunt
from xferkit.testing.sim.sweep import MIX


def speeds(seeds: int) -> list[dict[str, Any]]:
    rows = []
    run(0, MIX[0])  # imports and the reference model's memory, before the clock runs
    for config in dict.fromkeys(MIX):  # each distinct configuration once
        began = time.perf_counter()
        simulated = steps = 0.0
        for seed in range(seeds):
            result = run(seed, config)
            simulated += result.simulated_s
            steps += result.steps
        wall = time.perf_counter() - began
        rows.append({
            "config": f"{config.prefill_tp}->{config.decode_tp}, {config.requests} requests, "
                      f"staging {config.staging}"
                      + (f", decode of {config.decode_pp} stages" if config.decode_pp > 1 else "")
                      + (f", prefix hits {config.skip:g}" if config.skip else "")
                      + (f", layer-wise {config.layered:g}" if config.layered else "")
                      + ("" if config.notifying else ", Written on the socket")
                      + (", fencing" if config.fencing else "")
                      + (", pack worker" if config.packer else ""),
            "schedules_per_s": seeds / wall,
            "simulated_per_wall": simulated / wall,
            "steps_per_schedule": steps / seeds,
            "ms_per_schedule": 1000 * wall / seeds,
        })  # fmt: skip
    return rows


def power(budget: int) -> list[dict[str, Any]]:
    rows = []
    for m in MUTATIONS:
        began = time.perf_counter()
        got = hunt(m, budget)
        rows.append({
            "mutation": m.name,
            "defect": m.defect,
            "schedules": got.schedules if got.violation else None,
            "invariant": got.violation.invariant if got.violation else None,
            "seconds": time.perf_counter() - began,
            "first": str(got.violation) if got.violation else "",
        })  # fmt: skip
    return rows


def main() -> None:
    args = parser("sim", __doc__)
    args.add_argument("--seeds", type=int, default=200, help="schedules per configuration")
    args.add_argument("--budget", type=int, default=1500, help="schedules per defect at most")
    a = args.parse_args()
    fast = speeds(a.seeds)
    table(fast, [
        Column("configuration", "config", width=40, left=True),
        Column("sched/s", "schedules_per_s", ".1f"),
        Column("sim s/s", "simulated_per_wall", ",.0f"),
        Column("steps", "steps_per_schedule", ".0f", width=7),
        Column("ms", "ms_per_schedule", ".1f", width=7),
    ])  # fmt: skip
    found = power(a.budget)
    table(found, [
        Column("defect put back", "mutation", width=30, left=True),
        Column("schedules", lambda r: r["schedules"] or f"> {a.budget}", width=11),
        Column("invariant", lambda r: r["invariant"] or "-", width=11),
        Column("s", "seconds", ".1f", width=6),
    ])  # fmt: skip
    save(a.out, fast + found, seeds=a.seeds, budget=a.budget, outside=OUTSIDE)


if __name__ == "__main__":
    main()
