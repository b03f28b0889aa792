"""What an engine holds per request: ``Receive`` (decode side) and ``Send`` (prefill side).

The I/O thread moves them; the engine only reads them (``poll`` never blocks)
or asks for something (``wait``, ``abort``, ``Send.write``), which is queued
for the I/O thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..arguments import seconds
from ..errors import XferError
from ..manifest import Manifest
from .layerwise import check_layers
from .states import RequestError, Routes, State
from .timeline import Span

NO_ROUTES = Routes()
"""Every handle's routes until its request ended (immutable: one for all)."""


class Owner(Protocol):
    """What a handle asks of its session: queue a command, check slots, report its end."""

    manifest: Manifest

    def _submit(self, command: tuple[Any, ...]) -> None: ...
    def _local_slots(self, slots: object, what: str) -> dict[str, Any]: ...
    def _finished(self, handle: Any) -> None: ...


class _Handle:
    """A request's progress; ``poll`` never blocks, states only move forward, FAILED sticks."""

    def __init__(self, session: Owner, request_id: str) -> None:
        self.request_id = request_id
        self._session = session
        self._state = State.HANDSHAKING
        self._times = {State.HANDSHAKING: time.monotonic()}
        self._error: RequestError | None = None
        self._failing: RequestError | None = None
        self._routes = NO_ROUTES
        self._timeline: Mapping[str, Span] = {}
        # A plain lock, taken on every move (an RLock's ``with`` costs two Python calls), and a
        # gate per waiter, opened at the end (most handles are polled, never waited): a
        # ``Condition`` cost its waiter microseconds on the path from ``expect`` to DONE.
        self._lock = threading.Lock()
        self._gates: list[threading.Lock] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.request_id!r}, {self._state.name})"

    def poll(self) -> State:
        return self._state

    @property
    def error(self) -> RequestError | None:
        """The root cause once FAILED, else None."""
        return self._error

    @property
    def failing(self) -> RequestError | None:
        """The root cause as soon as the request is known to fail, while bytes of it may still
        land (it drains); ``poll()`` says FAILED, and the slots are safe to reuse, only once
        no byte can land any more."""
        return self._failing or self._error

    @property
    def times(self) -> dict[State, float]:
        """When the request reached each state it went through (``time.monotonic``): the
        per-request timeline (handshake, waiting for the other side, transfer, the end)."""
        with self._lock:
            return dict(self._times)

    @property
    def routes(self) -> Routes:
        """How the request went (chunks by route, waits for staging), once it ended."""
        return self._routes

    @property
    def timeline(self) -> Mapping[str, Span]:
        """Where the request's time went on this rank, once it ended: stage -> ``Span``
        (prefill: plan, pack, post, wire; decode: landed, unpack). See ``xferkit.Span``."""
        return self._timeline

    @property
    def done(self) -> bool:
        return self._state in (State.DONE, State.FAILED)

    def wait(self, timeout: float | None = None) -> State:
        """Block until DONE or FAILED; raise the root cause if FAILED.

        Past ``timeout`` it raises ``XferError`` and the request goes on.
        """
        limit = None if timeout is None else time.monotonic() + seconds(timeout, "timeout")
        with self._lock:
            while not self.done:
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    raise XferError(
                        f"request {self.request_id!r} still {self._state.name} after {timeout} s",
                        subject=self.request_id,
                    )
                self._sleep(left)
        if self._error is not None:
            raise self._error
        return self._state

    def abort(self, timeout: float = 10.0) -> None:
        """Fail the request on both sides (stage abort); return once it is FAILED.

        On the decode side that means every source confirmed no write into the
        request's slots is in flight or will be posted: the slots may be reused.
        ``timeout=0`` only asks: ``poll()`` says FAILED later, when that holds.
        """
        limit = time.monotonic() + seconds(timeout, "timeout")
        if self.done:  # nothing to abort (its Session may be closed: nothing to ask it)
            return
        self._session._submit(("abort", self))
        if timeout == 0:
            return
        with self._lock:
            while not self.done:
                left = limit - time.monotonic()
                if left <= 0:
                    raise XferError(
                        f"request {self.request_id!r}: abort not confirmed within {timeout} s",
                        subject=self.request_id,
                    )
                self._sleep(left)

    def _sleep(self, seconds: float | None) -> None:
        """Wait for the end (or ``seconds``), the lock held: it is released meanwhile; the
        control thread opens every gate at the end (``_open``)."""
        gate = threading.Lock()
        gate.acquire()
        if self._gates is None:
            self._gates = [gate]
        else:
            self._gates.append(gate)
        self._lock.release()
        # Past a lock's bound (``math.inf``: an engine's "forever") acquire would raise.
        bound = -1.0 if seconds is None or seconds > threading.TIMEOUT_MAX else seconds
        try:
            opened = gate.acquire(True, bound)
        finally:
            self._lock.acquire()
        if not opened and self._gates is not None and gate in self._gates:
            self._gates.remove(gate)

    def _open(self) -> None:
        """The end came (the lock held): every waiter goes on."""
        if self._gates is not None:
            for gate in self._gates:
                gate.release()
            self._gates = None

    # -- the I/O thread's side -------------------------------------------------

    def _move(self, state: State) -> bool:
        with self._lock:
            cur = self._state  # forward only, and FAILED (0) sticks
            if state <= cur or cur is State.FAILED:
                return False
            self._state = state
            t = time.monotonic()
            if state is State.DONE:  # it transferred, at the latest now (the core says DONE
                self._times.setdefault(State.TRANSFERRING, t)  # alone when the first is last)
                self._times[state] = t
                self._open()  # they wait for the end only
            else:
                self._times[state] = t
            return True

    def _done(self) -> None:
        if self._move(State.DONE):
            self._session._finished(self)

    def _failing_now(self, error: RequestError) -> None:
        if not self.done and self._failing is None:
            self._failing = error

    def _fail(self, error: RequestError) -> bool:
        with self._lock:
            if self.done:
                return False
            self._error, self._state = error, State.FAILED
            self._times[State.FAILED] = time.monotonic()
            self._open()
        self._session._finished(self)
        return True


class Receive(_Handle):
    """Decode side: the request's data arriving into ``slots`` from its source ranks."""


class Send(_Handle):
    """Prefill side: the request's data leaving, written chunk by chunk with ``write``."""

    def __init__(self, session: Owner, request_id: str) -> None:
        super().__init__(session, request_id)
        self._state = State.WAITING
        self._times = {State.WAITING: self._times.pop(State.HANDSHAKING)}
        self._last = False

    def write(
        self, slots: Mapping[str, Any], last: bool = False, layers: Iterable[int] | None = None
    ) -> None:
        """Send the next chunk: ``slots[pool]`` are source slots, mapped in order onto the next
        unfilled destination slots of that pool; ``last=True`` on the final chunk.

        ``layers``: only these layers' regions (a layer-wise write, as the forward pass
        finishes them); the same slots are then written for the other layers before the
        next chunk, and ``last`` goes on the chunk's final layers (``layerwise``).
        Checked against the local manifest at once; the write itself starts when
        the destination slots are known (now, or when the decode side names them).
        """
        if not isinstance(last, bool):
            raise XferError(f"write(last=) is a bool, not {last!r}")
        if self._last:
            raise XferError(f"request {self.request_id!r}: write() after the last chunk")
        what = f"request {self.request_id!r}: write()"
        checked = self._session._local_slots(slots, what)
        covers = check_layers(layers, self._session.manifest, what)
        if self.done:
            return  # failed already (or aborted): nothing more is written
        with self._lock:  # one write of several racing from threads is the last one
            if self._last:
                raise XferError(f"request {self.request_id!r}: write() after the last chunk")
            self._last = last
            self._session._submit(("write", self, checked, last, covers))  # in this order
