"""A test driver that copies in-process and lets a test decide what fails: httpx's MockTransport.

``Backend(MockDriver(handler))`` is a real backend: the core's guards run as
for any driver. The handler sees every primitive call and decides its fate
without any monkeypatching::

    def handler(call: Call) -> str | None:
        if call.op == "post" and call.count == 2:
            return "link down"          # the 2nd batch fails (asynchronously)
        if call.op == "register" and call.region.name == "v":
            raise RuntimeError("no")    # the driver refuses to register it
        return None                     # everything else works

Return ``STALL`` for a post that never completes until released.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import msgspec

from ..descriptors import Descriptors
from ..driver import Capabilities, Driver, Posted, Status
from ..manifest import Manifest, Region
from .reference import execute

STALL = "<stall>"
"""A handler's answer for a post that stays PENDING until the core releases it."""

OPS = (
    "register",
    "deregister",
    "endpoint",
    "connect",
    "disconnect",
    "post",
    "notify",
    "notifications",
    "close",
)


class Call(NamedTuple):
    """One primitive call: ``op``, its 1-based count among calls of that op, and its arguments."""

    op: str
    count: int  # type: ignore[assignment]  # shadows tuple.count, which nobody calls on a Call
    region: Region | None = None
    descs: Descriptors | None = None
    message: bytes | None = None
    link: Any = None


Handler = Callable[[Call], str | None]

_LIVE: weakref.WeakValueDictionary[str, MockDriver] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class _Blob(msgspec.Struct, frozen=True):
    address: str


class _Posted(Posted):
    def __init__(self, status: Status, error: str = "") -> None:
        self._status, self._error = status, error
        self.released = 0  # how many times the core released it (the contract: once)

    def poll(self) -> Status:
        return self._status

    @property
    def error(self) -> str:
        return self._error

    def release(self) -> None:
        self.released += 1
        if self._status is Status.PENDING:
            self._status, self._error = Status.FAILED, "released while stalled"


class MockDriver(Driver):
    """In-process copies, every call recorded in ``calls``, every fate chosen by ``handler``."""

    name: ClassVar[str] = "mock"
    Blob: ClassVar[type[msgspec.Struct]] = _Blob

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        max_batch: int = 0,
        notifications: bool = True,
        memory: frozenset[str] = frozenset({"cpu"}),
    ) -> None:
        self.handler = handler or (lambda call: None)
        self.capabilities = Capabilities(
            memory=memory, notifications=notifications, cross_process=False, max_batch=max_batch
        )
        self.address = f"mock-{next(_ids)}"
        self.calls: list[Call] = []
        self.registered: set[tuple[int, int]] = set()
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.handles: list[Any] = []  # every Posted returned by post/notify, in order
        self._counts = dict.fromkeys(OPS, 0)
        self._lock = threading.Lock()
        _LIVE[self.address] = self

    def _call(self, op: str, **args: Any) -> str | None:
        with self._lock:
            self._counts[op] += 1
            call = Call(op, self._counts[op], **args)
            self.calls.append(call)
        return self.handler(call)

    def of(self, op: str) -> list[Call]:
        """The recorded calls of one op."""
        return [c for c in self.calls if c.op == op]

    def register_region(self, region: Region) -> None:
        self._call("register", region=region)
        self.registered.add((region.addr, region.nbytes))

    def deregister_region(self, region: Region) -> None:
        self._call("deregister", region=region)
        self.registered.discard((region.addr, region.nbytes))

    def endpoint(self) -> msgspec.Struct:
        self._call("endpoint")
        return _Blob(self.address)

    def connect(self, blob: Any, manifest: Manifest) -> Any:
        self._call("connect", message=blob.address.encode())
        return blob.address

    def disconnect(self, link: Any) -> None:
        self._call("disconnect", link=link)

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        return self._deliver("post", link, descs, notify)

    def notify(self, link: Any, message: bytes) -> Posted:
        return self._deliver("notify", link, None, message)

    def _deliver(self, op: str, link: str, descs: Descriptors | None, note: bytes | None) -> Posted:
        posted = self._fate(op, link, descs, note)
        self.handles.append(posted)
        return posted

    def _fate(self, op: str, link: str, descs: Descriptors | None, note: bytes | None) -> _Posted:
        fate = self._call(op, descs=descs, message=note, link=link)
        if fate == STALL:
            return _Posted(Status.PENDING)
        if fate is not None:
            return _Posted(Status.FAILED, fate)
        target = _LIVE.get(link)
        if target is None:
            return _Posted(Status.FAILED, f"mock peer {link} is gone")
        if descs is not None:
            execute(descs)
        if note is not None:
            target.inbox.append((self.address, note))
        return _Posted(Status.DONE)

    def notifications(self) -> Sequence[tuple[str, bytes]]:
        self._call("notifications")
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        return out

    def close(self) -> None:
        self._call("close")
        _LIVE.pop(self.address, None)
