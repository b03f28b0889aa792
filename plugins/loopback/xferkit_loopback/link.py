"""A connected loopback peer: what its endpoint said, the process it names, its own worker."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

import msgspec
import numpy as np

from xferkit.driver import AddressTable, BatchWorker, Descriptors, QueuedBatch

from .copy import RemoteWord, start_time
from .host import HostId
from .notices import poke_name, socket_name


class LoopbackBlob(msgspec.Struct, frozen=True):
    """A loopback endpoint: who, which process (pid + start time is unique, on its host),
    which memory."""

    host: HostId  # the boot and namespaces the pid and the notification socket belong to
    pid: int
    id: str
    started: int  # the process's start time (clock ticks since boot)
    generation_addr: int  # where the peer keeps its registration generation
    generation: int  # the generation these regions belong to
    regions: list[tuple[int, int]]  # registered [start, end) at the time of endpoint()


class Job(QueuedBatch):
    __slots__ = ("fail", "link", "released")

    def __init__(
        self,
        link: Link,
        descs: Descriptors | None,
        notify: bytes | None,
        fail: str | None = None,
        stall: bool = False,
    ) -> None:
        super().__init__(descs, notify)
        self.link = link
        self.fail = fail  # injected failure text
        # A stalled job (injected) runs until released; the others need no event for it.
        self.released = threading.Event() if stall else None

    @property
    def stall(self) -> bool:
        return self.released is not None

    def release(self) -> None:
        super().release()
        if self.released is not None:
            self.released.set()  # ends the stall


class Link:
    """One peer: a pidfd naming its process (never a reused pid), and a worker of its own,
    so a stalled peer holds no other back."""

    def __init__(self, blob: LoopbackBlob, execute: Callable[[Job], str | None], name: str) -> None:
        self.address = f"{blob.pid}:{blob.id}"
        self.name = f"loopback:{self.address}"  # as the core names the peer
        self.blob = blob
        self.socket = socket_name(blob.id)
        self.pokes = poke_name(blob.id)
        table = np.array(blob.regions, dtype=np.uint64).reshape(-1, 2)
        self.registered = AddressTable(table[:, 0], table[:, 1] - table[:, 0])
        self.local = blob.pid == os.getpid()
        self.pidfd = -1 if self.local else _open_process(blob.pid, blob.started)
        self.exited = select.poll()  # readable pidfd: the process exited
        if self.pidfd >= 0:
            self.exited.register(self.pidfd, select.POLLIN)
        # Reads the peer's registration generation; only this link's worker uses it.
        self.generation_word = None if self.local else RemoteWord(blob.pid, blob.generation_addr)
        self.worker: BatchWorker[Job] = BatchWorker(execute, name=name)

    def close(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=10)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _open_process(pid: int, started: int) -> int:
    """A pidfd for ``pid``, checked to be the process that made the endpoint."""
    fd = os.pidfd_open(pid)
    if start_time(pid) != started:
        os.close(fd)
        raise ProcessLookupError(f"pid {pid} now names another process: the peer is gone")
    return fd
