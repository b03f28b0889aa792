"""Waiting for a rank process to start: for as long as it makes progress, within a cap.

A rank's setup is mostly the first touch of its pools: gigabytes for a decode rank sized
for hundreds of requests, which a VM whose fresh memory comes back slowly from its host
faulted in at 0.1-7 GB/s from one minute to the next (docs/performance.md). A fixed
deadline either fails a healthy rank there or waits minutes on a stuck one; a rank whose
resident memory still grows is not stuck.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Final, Protocol

STALL_S: Final = 120.0
"""No answer and no growth of the rank's resident memory for this long: it is stuck."""

CAP_S: Final = 1800.0
"""The longest any rank may take to start, however it progresses."""

_STEP_S: Final = 2.0
_GROWTH: Final = 16 << 20  # what counts as progress: a Python loop's few pages do not


def resident_bytes(pid: int | None) -> int:
    """The process's resident memory, 0 where it cannot be read (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Process(Protocol):
    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...


def wait_start(
    conn: Connection, proc: Process, *, stall_s: float = STALL_S, cap_s: float = CAP_S
) -> str | None:
    """Wait until ``conn`` has something to read; None once it has, else why it gave up
    (for the caller's error): the process ended, ``stall_s`` passed with no answer and its
    resident memory no larger, or ``cap_s`` passed in all."""
    began = time.monotonic()
    quiet_since, most = began, resident_bytes(proc.pid)
    while True:
        if not proc.is_alive() and not conn.poll(0):
            return f"exited (code {proc.exitcode}) before it answered"
        now = time.monotonic()
        if now - began >= cap_s:
            return f"did not answer within {cap_s:g} s"
        if now - quiet_since >= stall_s:
            return (
                f"did not answer within {now - began:.0f} s, its resident memory "
                f"({most / 2**30:.2f} GiB) not growing for the last {stall_s:g} s"
            )
        left = min(quiet_since + stall_s, began + cap_s) - now
        if conn.poll(min(_STEP_S, left)):
            return None
        size = resident_bytes(proc.pid)
        if size >= most + _GROWTH:  # still faulting its pools in
            quiet_since, most = time.monotonic(), size
