"""The data-plane worker: the one thread that calls the driver for the control plane.

Posts, polls, aborts, connects and disconnects run here, never on the control
thread, so that no driver call (NIXL copies host memory inside its post) can
delay a heartbeat. Each action comes from the protocol core; each result goes
back to it through ``report`` (the shell's event queue): ``("connected",
ident, peer, generation, error)`` and ``("write_ended", wid, error)``. A post that
waited past its ``not_after`` (this process was paused) is refused, not made.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..backend import Backend
from ..driver import Status
from ..errors import XferError
from ..transfer import Transfer
from . import actions as act
from .core import DRAIN_S, log

NAP_MIN_S = 2e-5
NAP_MAX_S = 1e-3
"""How often writes in flight are polled: at once after a post, then backing off to this."""


class DataPlane:
    """Carries out ``Connect``, ``Disconnect``, ``Post`` and ``Cancel`` on one thread."""

    def __init__(
        self, backend: Backend, report: Callable[[tuple[Any, ...]], None], name: str
    ) -> None:
        self.backend, self.report = backend, report
        self._queue: deque[act.Action] = deque()
        self._cond = threading.Condition()
        self._inflight: dict[int, Transfer] = {}
        self._cancelled: dict[int, float] = {}  # wid -> when we stop waiting for the driver
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"xferkit-data-{name}", daemon=True)
        self._thread.start()

    def submit(self, actions: list[act.Action]) -> None:
        with self._cond:
            self._queue.extend(actions)
            self._cond.notify()

    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._queue)

    def stop(self, timeout: float) -> None:
        """Let every write end (bounded by ``timeout``), then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        nap = NAP_MAX_S
        while True:
            with self._cond:
                if not self._queue:
                    if self._stopping and not self._inflight:
                        return
                    self._cond.wait(nap if self._inflight else 0.05)
                todo = list(self._queue)
                self._queue.clear()
            for action in todo:
                try:
                    self._do(action)
                except Exception:  # a bug: logged, and the loop goes on
                    log.exception("data plane: %s failed", type(action).__name__)
            if self._inflight:
                nap = NAP_MIN_S if todo else min(nap * 2, NAP_MAX_S)
                self._poll()

    def _do(self, action: act.Action) -> None:
        if isinstance(action, act.Post):
            if time.monotonic() > action.not_after:
                self.report(
                    (
                        "write_ended",
                        action.wid,
                        "not posted: this rank was paused past its "
                        "peer's liveness bound, which may have reused the memory",
                    )
                )
                return
            try:
                t = self.backend.write(
                    action.peer, action.descs, action.note, timeout=action.timeout
                )
            except XferError as exc:
                self.report(("write_ended", action.wid, str(exc)))
                return
            self._inflight[action.wid] = t
        elif isinstance(action, act.Cancel):
            pending = self._inflight.get(action.wid)
            if pending is not None:
                try:
                    pending.abort(action.why, wait=False)
                except XferError as exc:
                    log.error("data plane: %s", exc)
                self._cancelled[action.wid] = time.monotonic() + DRAIN_S
        elif isinstance(action, act.Connect):
            try:
                peer = self.backend.connect(action.endpoint, action.manifest)
            except XferError as exc:
                self.report(("connected", action.key, None, 0, str(exc)))
                return
            self.report(("connected", action.key, peer, peer.generation, ""))
        elif isinstance(action, act.Disconnect):
            try:
                self.backend.disconnect(action.peer)
            except XferError as exc:
                log.warning("data plane: disconnecting %s: %s", action.peer, exc)

    def _poll(self) -> None:
        now = time.monotonic()
        for wid, t in list(self._inflight.items()):
            st = t.poll()
            if st is Status.PENDING:
                limit = self._cancelled.get(wid)
                if limit is not None and now > limit:  # said once; it stays in flight
                    log.error("write %d: aborted, still in the driver after %s s", wid, DRAIN_S)
                    self._cancelled[wid] = float("inf")
                continue
            del self._inflight[wid]
            self._cancelled.pop(wid, None)
            self.report(("write_ended", wid, "" if st is Status.DONE else str(t.error)))
