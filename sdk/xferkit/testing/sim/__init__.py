"""Deterministic simulation of the Session's protocol core (``python -m xferkit.testing.sim``).

Many ranks run the real ``Protocol`` under a simulated clock, network and
driver, with faults drawn from a seed, and the invariants of
docs/reliability.md are checked after every step. A schedule is a seed and a
``Config``: ``run(seed, config)`` replays it exactly (within one Python hash
seed: the CLI pins it), ``trace=True`` records every call into a core.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import FAULTS, HARSH, Config
from .invariants import Violation
from .world import World

__all__ = ["FAULTS", "HARSH", "Config", "Result", "Violation", "World", "run"]


@dataclass(frozen=True)
class Result:
    seed: int
    violations: list[Violation]
    simulated_s: float
    steps: int
    outcomes: dict[str, int]
    trace: list[str] | None


def run(seed: int, config: Config | None = None, *, trace: bool = False) -> Result:
    """One schedule: every rank, request and fault from ``seed``."""
    world = World(seed, config or Config(), trace=trace)
    violations = world.run()
    return Result(seed, violations, world.now, world.steps, world.check.outcomes, world.trace)
