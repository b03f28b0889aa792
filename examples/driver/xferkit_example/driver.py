"""An in-process driver: copies with memmove when posted, notifications through a queue.

Small on purpose: it shows the whole contract. A real engine would post
asynchronously and reach other processes; this one completes every batch at
once (``Done``) and declares ``cross_process=False``.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections import deque
from typing import Any, ClassVar

import msgspec

from xferkit.driver import (
    AddressTable,
    Capabilities,
    Descriptors,
    Done,
    Driver,
    Manifest,
    Posted,
    Region,
)

_ids = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[str, ExampleDriver] = weakref.WeakValueDictionary()


class ExampleBlob(msgspec.Struct, frozen=True):
    """What a peer needs to reach us: the core encodes it and decodes it for us."""

    address: str
    generation: int  # our registration generation: the "remote key" writes must present


class ExampleDriver(Driver):
    name: ClassVar[str] = "example"
    Blob: ClassVar[type[msgspec.Struct]] = ExampleBlob

    def __init__(self, *, max_batch: int = 0) -> None:
        self.capabilities = Capabilities(notifications=True, max_batch=max_batch)
        self.address = f"example-{next(_ids)}"
        self.regions: dict[int, int] = {}  # start -> nbytes
        self.generation = 0  # bumped whenever registered memory changes
        self.inbox: deque[tuple[str, bytes]] = deque()
        _LIVE[self.address] = self

    def register_region(self, region: Region) -> None:
        self.regions[region.addr] = region.nbytes
        self.generation += 1

    def deregister_region(self, region: Region) -> None:
        del self.regions[region.addr]
        self.generation += 1

    def endpoint(self) -> ExampleBlob:
        return ExampleBlob(self.address, self.generation)

    def connect(self, blob: Any, manifest: Manifest) -> Any:
        return blob  # the link: whatever post() needs to find the peer

    def _peer(self, link: ExampleBlob) -> ExampleDriver:
        peer = _LIVE.get(link.address)
        if peer is None:
            raise RuntimeError(f"peer {link.address} is gone")
        if peer.generation != link.generation:  # like a NIC refusing a stale remote key
            raise RuntimeError(f"peer {link.address} re-registered its memory: stale endpoint")
        return peer

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        peer = self._peer(link)
        # Like a NIC: the destination must be registered by the peer right now.
        starts = list(peer.regions)
        table = AddressTable(starts, [peer.regions[s] for s in starts])
        if table.first_outside(descs.dst, descs.nbytes) >= 0:
            raise RuntimeError(f"a destination is not registered by {link.address}")
        copies = zip(descs.src.tolist(), descs.dst.tolist(), descs.nbytes.tolist(), strict=True)
        for s, d, n in copies:  # an example: a real engine copies a batch in one call
            ctypes.memmove(d, s, n)
        if notify is not None:
            peer.inbox.append((self.address, notify))
        return Done()

    def notify(self, link: Any, message: bytes) -> Posted:
        peer = self._peer(link)
        peer.inbox.append((self.address, message))
        return Done()

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        return out

    def close(self) -> None:
        _LIVE.pop(self.address, None)
