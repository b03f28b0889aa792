"""CPU time of the rank processes, read from ``/proc``: what a case costs the host's cores.

On a machine whose cores the ranks saturate (a 2-core VM, an engine's host under load), a
load moves what the cores afford: its GB/s is cores over CPU seconds per GB. So a row
reports those seconds per GB beside its GB/s, per role, measured over the same requests:
a load that reaches less than one large request does because each of its requests costs
CPU apart from its bytes (messages, plans, rounds, posts, completions), or because the
cores sat idle. Each process's every thread counts: the Session's, the driver's, the
rank's own harness. The kernel counts in ticks (``SC_CLK_TCK``: 10 ms here), so a row
should run for seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int | None, tid: int | None = None) -> float | None:
    """User and system seconds of process ``pid`` (every thread), or of its thread ``tid``;
    None where they cannot be read (the process gone, or no ``/proc``: not Linux)."""
    if pid is None:
        return None
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, ValueError, IndexError):
        return None


def threads_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` by its name at the OS (``comm``: the first 15
    characters), threads of one name summed; the main thread under ``main``."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = "main" if int(tid) == pid else f.read().strip()
        except (OSError, ValueError):
            continue
        s = cpu_s(pid, int(tid))
        if s is not None:
            out[name] = out.get(name, 0.0) + s
    return out


KINDS = (  # (what a thread's OS name starts with, its kind): the first match counts
    ("main", "engine"),  # a rank's main thread: the engine's expect, offer, write, wait
    ("xk-control", "control"),
    ("xk-data", "data"),
    ("xk-pack", "pack"),
    ("ZMQbg", "zmq"),
    ("bench-", "bench"),
)
"""The Session's threads name themselves at the OS (``xferkit.threadname``). Every other
thread of a rank, including any that ended, is the driver's: ``driver`` is the process's
CPU less these."""


def kinds_s(pids: Iterable[int | None]) -> dict[str, float] | None:
    """CPU seconds of every process in ``pids`` together, by kind of thread (``KINDS``, and
    ``driver``) and in ``all``; None if one cannot be read."""
    out = {kind: 0.0 for _, kind in KINDS} | {"driver": 0.0, "all": 0.0}
    for pid in pids:
        total = cpu_s(pid)
        if pid is None or total is None:
            return None
        named = 0.0
        for name, seconds in threads_s(pid).items():
            kind = next((k for prefix, k in KINDS if name.startswith(prefix)), None)
            if kind is not None:
                out[kind] += seconds
                named += seconds
        out["all"] += total
        out["driver"] += max(total - named, 0.0)  # read a moment apart: never below none
    return out
