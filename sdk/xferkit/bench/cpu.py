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


def summed(pids: Iterable[int | None]) -> float | None:
    """CPU seconds of every process in ``pids`` together; None if one cannot be read."""
    total = 0.0
    for pid in pids:
        s = cpu_s(pid)
        if s is None:
            return None
        total += s
    return total
