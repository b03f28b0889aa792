"""A rank process started inside a host: freeze, resume, kill and restart it, as faults do."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...closing import Closing
from ..peer import state
from .ip import HostError


class Process(Closing):
    """``argv`` run inside a host's namespaces (``ip netns exec``, which execs: ``pid`` is the
    command's own). ``restart`` runs the same command again in the same host."""

    def __init__(self, host: str, prefix: Sequence[str], argv: Sequence[str], **popen: Any) -> None:
        self.host = host
        self.argv = list(argv)
        self._prefix = list(prefix)
        self._popen = popen
        self.popen = self._start()

    def _start(self) -> subprocess.Popen[Any]:
        try:
            return subprocess.Popen([*self._prefix, *self.argv], **self._popen)
        except OSError as exc:
            why = f"{self.host}: starting {self.argv[0]}: {exc}"
            raise HostError(why, subject=self.host) from exc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _signal(self, sig: signal.Signals) -> None:
        if not self.alive():
            raise HostError(
                f"{self.host}: process {self.pid} ({self.argv[0]}) has exited "
                f"(code {self.popen.returncode}); cannot send {sig.name}",
                subject=self.pid,
            )
        os.kill(self.pid, sig)

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP: the process holds its sockets and memory but answers nothing. Returns once
        the kernel shows it stopped (a signal lands asynchronously)."""
        self._signal(signal.SIGSTOP)
        self._until(lambda state: state in "Tt", "stopped", timeout)

    def resume(self, timeout: float = 10.0) -> None:
        """SIGCONT after ``freeze``; returns once it runs again."""
        self._signal(signal.SIGCONT)
        self._until(lambda state: state not in "Tt", "running", timeout)

    def _until(self, done: Callable[[str], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done(state := self.state()):
            if time.monotonic() > deadline:
                raise HostError(
                    f"{self.host}: process {self.pid} not {what} after {timeout} s (state {state})",
                    subject=self.pid,
                )
            time.sleep(0.002)

    def state(self) -> str:
        """The process's state letter in /proc (``T``: stopped, ``S``/``R``: running)."""
        try:
            return state(self.pid)
        except OSError as exc:
            raise HostError(f"{self.host}: process {self.pid}: {exc}", subject=self.pid) from exc

    def kill(self) -> int:
        """SIGKILL, then reap; the exit code (negative: the signal)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        return self.popen.wait()

    def restart(self) -> None:
        """Kill the process if it runs, and start the same command in the same host."""
        self.kill()
        self.popen = self._start()

    def close(self) -> None:
        """Kill and reap; closes the pipes the process was started with."""
        self.kill()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
