"""A rank in another process, for cross-process tests: ``python -m xferkit.testing.peer``.

It speaks JSON lines on stdin/stdout. Both ends build the same ``Reference``
(same specs, same seed), so the peer can check what it received, or write
its own shard, without any bytes crossing the control pipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec

from ..backend import Backend
from ..closing import Closing
from ..manifest import Manifest
from ..planner import plan
from ..plugins import open_backend
from .reference import Reference, RegionSpec

Slots = dict[str, tuple[list[int], list[int]]]


class Setup(msgspec.Struct, tag=True):
    backend: str
    options: dict[str, Any]
    specs: list[RegionSpec]
    src_tp: int
    dst_tp: int
    src_slots: dict[str, int]
    dst_slots: dict[str, int]
    role: str  # "src" or "dst"
    index: int  # which rank of that side this process is
    seed: int = 0


class Check(msgspec.Struct, tag=True):
    slots: Slots


class Write(msgspec.Struct, tag=True):
    endpoint: bytes
    manifest: bytes
    slots: Slots
    notify: bytes | None = None


class Drain(msgspec.Struct, tag=True):
    """Return the notifications received so far, waiting up to ``timeout`` for one."""

    timeout: float = 0.0


class Reregister(msgspec.Struct, tag=True):
    """Deregister, then register the same memory again: endpoints handed out before are stale."""


class Fill(msgspec.Struct, tag=True):
    """Set every byte of this rank's memory to ``value`` (a sentinel a later write shows on)."""

    value: int


class Quit(msgspec.Struct, tag=True):
    pass


Request = Setup | Check | Write | Drain | Reregister | Fill | Quit


class Reply(msgspec.Struct):
    ok: bool
    error: str = ""
    endpoint: bytes = b""
    manifest: bytes = b""
    notes: list[tuple[str, bytes]] = []


def reference(s: Setup) -> Reference:
    """The same reference model the parent built: same specs, sizes and seed."""
    sizes = {f: getattr(s, f) for f in ("src_tp", "dst_tp", "src_slots", "dst_slots", "seed")}
    return Reference(s.specs, **sizes)


def serve() -> None:
    decoder = msgspec.json.Decoder(Request)
    backend: Backend | None = None
    ref: Reference | None = None
    index, role = 0, "dst"
    for line in sys.stdin:
        req = decoder.decode(line)
        try:
            if isinstance(req, Quit):
                break
            if isinstance(req, Setup):
                ref, index, role = reference(req), req.index, req.role
                rank = (ref.srcs if req.role == "src" else ref.dsts)[index]
                backend = open_backend(req.backend, **req.options)
                backend.register(rank.manifest)
                reply = Reply(True, endpoint=backend.endpoint(), manifest=rank.manifest.encode())
            elif backend is None or ref is None:
                reply = Reply(False, "send Setup first")
            elif isinstance(req, Check):
                ref.check(index, req.slots)
                reply = Reply(True)
            elif isinstance(req, Write):
                dst = Manifest.decode(req.manifest)
                peer = backend.connect(req.endpoint, dst)
                assert backend.manifest is not None  # registered at Setup
                descs = plan(backend.manifest, dst).expand(req.slots)
                backend.write(peer, descs, req.notify).wait(60)
                reply = Reply(True)
            elif isinstance(req, Reregister):
                manifest = backend.manifest
                assert manifest is not None
                backend.deregister()
                backend.register(manifest)
                reply = Reply(True, endpoint=backend.endpoint(), manifest=manifest.encode())
            elif isinstance(req, Fill):
                for array in (ref.srcs if role == "src" else ref.dsts)[index].arrays.values():
                    array[...] = req.value
                reply = Reply(True)
            elif isinstance(req, Drain):
                notes = backend.notifications(timeout=req.timeout)
                reply = Reply(True, notes=[(n.peer, n.message) for n in notes])
        except Exception as exc:
            reply = Reply(False, f"{type(exc).__name__}: {exc}")
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
        sys.stdout.flush()
    if backend is not None:
        backend.close()


class PeerProcess(Closing):
    """The parent's handle on a peer process; ``prefix`` runs it elsewhere (another host of
    ``xferkit.testing.hosts``: ``host.prefix()``)."""

    def __init__(self, prefix: Sequence[str] = ()) -> None:
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "xferkit.testing.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._decoder = msgspec.json.Decoder(Reply)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def ask(self, request: Setup | Check | Write | Drain | Reregister | Fill) -> Reply:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(msgspec.json.encode(request).decode() + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process {self.pid} exited (code {self._proc.wait()})")
        return self._decoder.decode(line)

    @contextmanager
    def frozen(self, timeout: float = 10.0) -> Iterator[None]:
        """Stopped (SIGSTOP) for the block, as a hung host would be: entered once the kernel
        shows it stopped, since a signal lands asynchronously and a write issued right after
        ``kill`` could still be served; resumed (SIGCONT) on the way out."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + timeout
            while state(self.pid) not in "Tt":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peer process {self.pid} not stopped after {timeout} s")
                time.sleep(0.002)
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def receiver(
        self, backend: str, specs: list[RegionSpec], slots: int, options: dict | None = None
    ) -> tuple[bytes, Manifest]:
        """Set this process up as decode rank 0 of TP 1 (``slots`` slots of each pool of
        ``specs``) on ``backend``; its endpoint and manifest."""
        pools = {spec.pool: slots for spec in specs}
        ready = self.ask(
            Setup(
                backend=backend, options=options or {}, specs=specs, src_tp=1, dst_tp=1,
                src_slots=pools, dst_slots=pools, role="dst", index=0,
            )
        )  # fmt: skip
        assert ready.ok, ready.error
        return ready.endpoint, Manifest.decode(ready.manifest)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(msgspec.json.encode(Quit()).decode() + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=20)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()


def state(pid: int) -> str:
    """Process ``pid``'s state letter in /proc (``T``: stopped, ``S``/``R``: running)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


if __name__ == "__main__":
    serve()
