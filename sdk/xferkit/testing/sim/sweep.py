"""Many schedules at once: seeds split over worker processes, configurations taken in turn."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from . import run
from .config import Config

CHUNK = 250
"""Seeds per task handed to a worker."""


@dataclass
class Sweep:
    schedules: int = 0
    simulated_s: float = 0.0
    violations: list[str] = field(default_factory=list)  # the first of each failing schedule


def _chunk(first: int, count: int, configs: Sequence[Config]) -> Sweep:
    out = Sweep()
    for seed in range(first, first + count):
        result = run(seed, configs[seed % len(configs)])
        out.schedules += 1
        out.simulated_s += result.simulated_s
        if result.violations:
            out.violations.append(str(result.violations[0]))
    return out


def sweep(first: int, count: int, configs: Sequence[Config], workers: int = 1) -> Sweep:
    """Seeds ``first .. first + count``, seed ``s`` under ``configs[s % len(configs)]``."""
    total = Sweep()
    parts = [(s, min(CHUNK, first + count - s)) for s in range(first, first + count, CHUNK)]
    if workers <= 1:
        done = [_chunk(s, n, configs) for s, n in parts]
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = list(pool.map(_chunk, *zip(*parts, strict=True), [configs] * len(parts)))
    for part in done:
        total.schedules += part.schedules
        total.simulated_s += part.simulated_s
        total.violations += part.violations
    return total


ONE_PAIR = Config(prefill_tp=1, decode_tp=1, requests=3, arrivals_s=26.0, staging="never",
                  hostile_acts=6, heartbeat_s=2.0, dead_after_s=10.0)  # fmt: skip
MIX = (
    *[ONE_PAIR] * 3,
    replace(ONE_PAIR, decode_pp=2),  # a pipelined decode: two stages, each its layers
    replace(ONE_PAIR, skip=0.5),  # half the decode ranks hold a prefix (expect(skip=))
    replace(ONE_PAIR, layered=0.5),  # half the prefill ranks write layer by layer
    replace(ONE_PAIR, notifying=False),  # completions as ``Written`` on the control socket
    replace(ONE_PAIR, fencing=True),  # decode drivers that fence a lost source
    replace(ONE_PAIR, ends_final=False),  # a released write still lands (NIXL over UCX TCP)
    replace(ONE_PAIR, decode_tp=2, staging="auto"),
    replace(ONE_PAIR, prefill_tp=2, staging="always", layered=0.3, packer=True),
)
"""The CI budget's configurations: mostly one pair on direct routes (the cheapest per simulated
second; one in eleven on a driver without notifications, one on drivers that fence, one on
drivers whose released writes still land, one with
prefix cache hits, one writing layer by layer, one into a decode of two pipeline stages),
some staged TP (one packing on the Session's worker), all with a heartbeat every 2 s (a ping
costs steps, not simulated time: 18% more simulated seconds per second than at 1 s); wider
shapes, more hostile bursts, staging contention and the other time constants run in the
hypothesis search, the mutation hunts (2 -> 2, staged) and ``make sim``."""
