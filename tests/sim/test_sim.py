"""The simulator (``xferkit.testing.sim``): schedules replay exactly, the checker catches what
it must, every defect put back is found, and the real protocol core holds every invariant
over the seeds that once failed, a hypothesis search and a bulk run of the CI budget
(docs/reliability.md, "The simulator")."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit.testing.sim import FAULTS, Config, run
from xferkit.testing.sim.mutations import MUTATIONS, Mutation, hunt
from xferkit.testing.sim.sweep import MIX, sweep

FOUND = [
    # (seed, config, what it found before the fix; docs/reliability.md)
    (751, Config(), "a refused pair's Request failed a place the honest rank claimed"),
    (844, Config(), "the same"),
    (864, Config(), "the same"),
    (1698, Config(), "close() said FAILED and a write already in the driver landed after"),
    (2122, Config(), "the same"),
    (24, Config(prefill_tp=1, decode_tp=1, requests=3, arrivals_s=20, heartbeat_s=2,
                dead_after_s=10), "a place the hostile claimed first, misread"),
    (273, Config(prefill_tp=4, decode_tp=2, requests=10), "a closed Session's calls replayed"),
    (1124, Config(decode_pp=2), "a request resolved from a cached roster that named the hostile "
     "prefill: the checker did not count it as asked (its Bye failed the request, rightly)"),
    (2262, Config(decode_pp=2), "the same"),
    (5794, Config(prefill_tp=1, decode_tp=2, requests=8, staging="always"), "a prefill paused "
     "past dead_after_s failed its requests one by one as it resumed: the first one's staging, "
     "given back, woke a later one's waiting chunk, which posted its rounds to the lost decode "
     "rank before its own turn to fail; they landed in staging the decode rank had taken back"),
    (1297, Config(prefill_tp=1, decode_tp=2, requests=8, staging="always"), "the same"),
    (5574, Config(prefill_tp=1, decode_tp=2, requests=8, staging="always"), "the same"),
]  # fmt: skip
BUDGET = 1500
"""Schedules each mutation may take to be found (the docs' table has the counts)."""
SWEEP = 20_000
"""Seeds of the bulk run (the rest of this module runs about 4,000 more)."""


def test_a_schedule_replays_exactly() -> None:
    first, again = run(11, trace=True), run(11, trace=True)
    assert first.trace and first.trace == again.trace
    assert (first.steps, first.simulated_s) == (again.steps, again.simulated_s)
    assert run(12, trace=True).trace != first.trace


@pytest.mark.parametrize(("seed", "config", "what"), FOUND, ids=[str(f[0]) for f in FOUND])
def test_the_schedules_that_found_defects_hold_now(seed: int, config: Config, what: str) -> None:
    result = run(seed, config)
    assert result.violations == [], what


def test_a_transport_that_stops_with_its_process_is_caught() -> None:
    """The harsh ``frozen`` driver (a TCP transport: what it had in flight lands once the
    stopped prefill resumes) breaks invariant 1 after the drain bound: the gap issue 21
    measured across hosts (megabytes in reused slots), which only a receive-side fence
    closes. The checker must see it."""
    config = Config(faults=FAULTS | {"frozen"})
    found = [v for s in range(120) for v in run(s, config).violations]
    assert any(v.invariant == 1 and "not offered" in v.what for v in found)


def test_a_driver_that_fences_survives_a_transport_that_stops_with_its_process() -> None:
    """The same schedules with decode drivers that fence (``Capabilities.fencing``): the
    decode rank cuts a lost source's links before it says FAILED, and nothing lands."""
    config = Config(faults=FAULTS | {"frozen"}, fencing=True)
    found = [v for s in range(120) for v in run(s, config).violations]
    assert found == [], found[0]


def test_a_driver_whose_fence_cuts_every_source_survives_the_same_schedules() -> None:
    """Decode drivers whose fence cuts every source's links at once (Mooncake over TCP
    retires the registration they all write to), two prefill instances of TP 2: the pairs
    cut with a lost source fail their requests before any of their writes could land, and
    nothing lands after FAILED."""
    config = Config(
        prefill_tp=2, decode_tp=2, instances=2, faults=FAULTS | {"frozen"}, fencing=True,
        fence_cuts_all=True,
    )  # fmt: skip
    found = [v for s in range(60) for v in run(s, config).violations]
    assert found == [], found[0]


@pytest.mark.parametrize("fencing", [False, True], ids=["no fence", "fence cuts all"])
def test_a_driver_whose_released_writes_still_land_survives_the_same_schedules(
    fencing: bool,
) -> None:
    """Drivers whose ends are not final (``Capabilities.ends_are_final=False``: NIXL, whose
    release over UCX's TCP lets queued puts go out), with or without a fence that cuts every
    source (NIXL over TCP has one, its defaults not): a request a source aborted or failed is
    FAILED only once the ``Ended`` notification behind its writes landed, and nothing lands
    after FAILED. Before, the decode rank said FAILED at the AbortAck."""
    faults = FAULTS | {"frozen"} if fencing else FAULTS  # frozen needs a fence (above)
    config = Config(faults=faults, ends_final=False, fencing=fencing, fence_cuts_all=fencing)
    found = [v for s in range(60) for v in run(s, config).violations]
    assert found == [], found[0]


def test_a_driver_that_lands_bytes_after_a_write_ended_is_caught() -> None:
    """The harsh ``late`` driver (UCX over TCP did this) breaks invariant 1, which no
    control plane can prevent without fencing: the checker must see it."""
    config = Config(faults=FAULTS | {"late"})
    found = [v for s in range(60) for v in run(s, config).violations]
    assert any(v.invariant == 1 and "reported ended" in v.what for v in found)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_defect_put_back_is_found(mutation: Mutation) -> None:
    got = hunt(mutation, BUDGET)
    assert got.violation is not None, f"{mutation.name}: none in {BUDGET} schedules"


def test_the_command_line_prints_a_line_per_violation_and_exits_non_zero() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [sys.executable, "-m", "xferkit.testing.sim"]
    ok = subprocess.run([*cmd, "--seeds", "20"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert re.fullmatch(r"20 schedules, 0 violations, \d+ simulated seconds \(.*\)",
                        ok.stdout.strip().splitlines()[-1])  # fmt: skip
    bad = subprocess.run([*cmd, "--seeds", "40", "--faults", "+late"], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    first = next(line for line in lines if line.startswith("seed "))
    assert re.match(r"seed \d+ step \d+ t=[\d.]+: invariant 1: ", first)
    seed = int(first.split()[1])
    replay = subprocess.run([*cmd, "--seed", str(seed), "--faults", "+late", "--trace"],
                            capture_output=True, text=True, env=env)  # fmt: skip
    assert replay.returncode == 1 and first in replay.stdout  # the same schedule, exactly
    assert " expect <decode " in replay.stdout


FAULT_SETS = st.sets(st.sampled_from(sorted(FAULTS))).map(frozenset)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    prefill=st.sampled_from([1, 2, 4]),  # the model's heads split 1, 2 or 4 ways
    stages=st.sampled_from([1, 1, 2]),  # the prefill's pipeline stages
    instances=st.sampled_from([1, 1, 2]),  # prefill instances, each request from one
    decodes=st.sampled_from([1, 1, 2]),  # decode instances, each request to one
    decode=st.sampled_from([1, 2, 4]),
    decode_stages=st.sampled_from([1, 1, 2]),  # the decode's pipeline stages
    requests=st.integers(1, 8),
    faults=FAULT_SETS,
    heartbeat=st.sampled_from([0.5, 1.0, 2.0]),
    dead_after=st.integers(3, 8),
    staging=st.sampled_from(["never", "auto", "always"]),
    staging_bytes=st.sampled_from([1 << 14, 1 << 16]),
    notifying=st.booleans(),
    fencing=st.sampled_from(["no", "source", "all"]),  # what a decode driver's fence cuts
    ends_final=st.booleans(),  # False: a released write still lands (with notifications)
    packer=st.booleans(),  # staged rounds pack on the Session's worker, or in the core's call
    skip=st.sampled_from([0.0, 0.0, 0.5]),  # the share of decode ranks holding a prefix
    layered=st.sampled_from([0.0, 0.0, 0.5]),  # the share of prefill ranks writing per layer
)
def test_a_search_over_shapes_faults_and_time_constants_finds_nothing(
    seed: int, prefill: int, stages: int, instances: int, decode: int, decode_stages: int,
    decodes: int, requests: int,
    faults: frozenset[str], heartbeat: float, dead_after: int, staging: str, staging_bytes: int,
    notifying: bool, fencing: str, ends_final: bool, packer: bool, skip: float, layered: float,
) -> None:  # fmt: skip
    config = Config(
        prefill_tp=prefill, prefill_pp=stages, instances=instances, decode_tp=decode,
        decode_pp=decode_stages, decode_instances=decodes, requests=requests, faults=faults,
        heartbeat_s=heartbeat, dead_after_s=heartbeat * dead_after, staging=staging,
        staging_bytes=staging_bytes, notifying=notifying, fencing=fencing != "no",
        fence_cuts_all=fencing == "all", ends_final=ends_final or not notifying, packer=packer,
        skip=skip, layered=layered,
    )  # fmt: skip
    result = run(seed, config)
    assert result.violations == [], f"replay: run({seed}, {config})"


def test_the_ci_budget_finds_nothing() -> None:
    """A million simulated seconds over 20,000 schedules, on both cores."""
    got = sweep(100_000, SWEEP, MIX, workers=2)
    assert got.violations == []
    assert got.schedules == SWEEP
    assert got.simulated_s > 1e6
