"""The ``ip`` and ``tc`` commands, the harness's names, and the sweep of a killed run's leftovers.

Every namespace the harness makes is named ``xk-<pid>-<what>``, ``pid`` being
the process that made it: a name whose process is gone belongs to a run that
was killed before it could clean up, and ``sweep`` removes it (processes left
inside first, so that its links go too). A live run's names, another
engineer's included, are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Sequence

from ...errors import XferError

PREFIX = "xk-"
"""What every namespace the harness makes is named with."""

_OWNED = re.compile(rf"^{PREFIX}(\d+)-")


class HostError(XferError):
    """A command of the multi-host harness failed; the message names it and quotes its text."""


def sh(args: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> str:
    """Run ``args`` (``ip ...``, ``tc ...``); its stdout, or ``HostError`` with its stderr."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError(f"{' '.join(args)}: {exc}", subject=args[0]) from exc
    if check and done.returncode != 0:
        raise HostError(
            f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}",
            subject=" ".join(args),
        )
    return done.stdout


def namespaces() -> list[str]:
    """Every network namespace ``ip netns`` names."""
    return [line.split()[0] for line in sh(["ip", "netns", "list"]).splitlines() if line.strip()]


def owner(name: str) -> int | None:
    """The pid that made namespace ``name``, or None when the harness did not name it."""
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(name: str) -> None:
    """Kill what runs in namespace ``name``, then delete it (its veth ends go with it)."""
    for pid in sh(["ip", "netns", "pids", name], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    sh(["ip", "netns", "delete", name], check=False)


def sweep() -> list[str]:
    """Remove the namespaces of harness runs whose process is gone; the names removed."""
    stale = [n for n in namespaces() if (pid := owner(n)) is not None and not _alive(pid)]
    for name in stale:
        remove(name)
    return stale
