"""What a process holds, read from /proc: resident memory, threads, file descriptors.

The bounds the hostile tests assert are on these, measured from outside the
process that runs the Session, never from the Session's own tables.
"""

from __future__ import annotations

import os
from collections import Counter

MIB = 1 << 20


def rss(pid: int) -> int:
    """Resident set size in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds(pid: int) -> Counter[str]:
    """Open descriptors by kind: ``socket``, ``pidfd``, ``other`` (``all`` counts every one)."""
    out: Counter[str] = Counter()
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:  # closed between the listing and the read
            continue
        kind = (
            "socket" if target.startswith("socket:") else "pidfd" if "pidfd" in target else "other"
        )
        out[kind] += 1
        out["all"] += 1
    return out
