"""The data-plane worker: the thread that calls the driver for the control plane.

Polls, aborts, connects, disconnects, fences and every large post run here,
never on the control thread, so that no driver call (NIXL copies host memory
inside its post) can delay a heartbeat; a small post (``INLINE_BYTES``) of a
driver whose posts are quick (``INLINE_S``) goes out at once from the control
thread when nothing waits here, as a hand-over would cost more than the post.
A driver that says when a batch ends (``Posted.on_end``: the loopback, Mooncake)
has the control thread poll that write then (``poll_kicked``: its poll reads a
status), unless its calls turned slow; others' writes are polled here every
``POLL_S``, and every write every ``CHECK_S`` for its deadline.
Each action comes from the protocol core; each result goes back to it through
``report`` (the shell's event queue): ``("connected", ident, peer, generation,
error)``, ``("fenced", source, error, new endpoint)``, ``("write_ended", wid,
error)``, for a poll ``("writes_ended", [(wid, error, seconds inside the
driver's post), ...])``, and ``("kicked",)`` when writes wait for ``poll_kicked``.
A post still queued when this process was stopped for longer than its ``horizon``
is refused, not made (the worker sees the stop as a wait that overran).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..backend import Backend
from ..driver import Status
from ..errors import XferError
from ..threadname import name_thread
from ..transfer import Transfer
from . import actions as act
from .core import DRAIN_S, log

INLINE_BYTES = 4 << 20
INLINE_DESCRIPTORS = 1024
"""A post at most this large is made on the calling (control) thread when nothing waits for
the worker: it costs the driver tens of microseconds (a NIXL host copy of 4 MiB: about a
millisecond), far below any heartbeat, and a hand-over to the worker would cost two thread
switches on the hot path. Larger posts, and every poll, run on the worker."""

INLINE_S = 5e-4
SLOW_POSTS = 3
SLOW_S = 1.0
"""``SLOW_POSTS`` inline posts in a row that each took longer than ``INLINE_S`` (a driver that
moves the bytes inside its post, as NIXL on host memory does) send the posts of the next
``SLOW_S`` to the worker: under load a backlog of such posts on the control thread delayed the
heartbeats behind it by seconds, and a decode rank declared its live prefill rank lost.
Several in a row, because a single post slowed by a preemption or a garbage collection sent a
second of loopback posts through the worker's hop (a third of the one-page posts of
``bench_session.py``)."""

STALL_S = 0.05
"""A wait that overran by more than this counts as the process having been stopped."""

AWAKE_S = 0.2
"""How long the worker keeps waking every ``POLL_S`` after its last work: a write posted
inline meanwhile needs no wake-up (which would take the GIL from the driver's threads just
as they move its bytes)."""

POLL_S = 1e-3
"""How often writes in flight are polled when their driver cannot wake us as one ends
(``Posted.on_end``); at most that often, however many actions arrive: polling every write
after every post made a burst of requests quadratic."""

CHECK_S = 0.05
"""How often writes whose driver wakes us as they end are polled all the same: for their
deadlines, and for an abort's drain."""


class DataPlane:
    """Carries out ``Connect``, ``Disconnect``, ``Fence``, ``Post`` and ``Cancel`` on one
    thread."""

    def __init__(
        self, backend: Backend, report: Callable[[tuple[Any, ...]], None], name: str
    ) -> None:
        self.backend, self.report = backend, report
        self._queue: deque[act.Action] = deque()
        self._cond = threading.Condition()
        self._inflight: dict[int, Transfer] = {}
        self._polled: set[int] = set()  # writes in flight whose driver cannot wake us
        self._kicked: set[int] = set()  # writes whose driver said a batch ended: poll now
        self._asked = False  # a report asked the control thread to poll them (``_kick``)
        self._wakes = False  # the last write posted wakes us as it ends
        self._cancelled: dict[int, float] = {}  # wid -> when we stop waiting for the driver
        self._stopping = False
        self._posted = False  # a post was made since the last poll
        self._awake_until = 0.0  # polling every POLL_S until then, even with nothing in flight
        self._slow_until = 0.0  # posts go to the worker until then (see INLINE_S)
        self._slow_calls = {"post": 0, "poll": 0}  # of each, calls in a row over INLINE_S
        self._stall = (0.0, 0.0)  # the last time this worker was stopped: (since, for how long)
        self._last: Transfer | None = None  # the last write posted on the caller's thread
        self.behind = False  # that write was still running when the next one was made
        self._thread = threading.Thread(target=self._run, name=f"xferkit-data-{name}", daemon=True)
        self._thread.start()

    def submit(self, actions: list[act.Action]) -> None:
        with self._cond:
            self._queue.extend(actions)
            self._cond.notify()

    def post(self, action: act.Post) -> None:
        """Make a small post now (see ``INLINE_BYTES``), else queue it for the worker."""
        d = action.descs
        now = time.monotonic()
        with self._cond:
            later = bool(self._queue) or len(d) > INLINE_DESCRIPTORS or d.total_bytes > INLINE_BYTES
            idle = not self._inflight and now > self._awake_until
        if later or now < self._slow_until:
            self.submit([action])
            return
        last = self._last
        self._do(action)
        self._timed(now, "post")
        self._last = self._inflight.get(action.wid)
        if last is not None and last.poll() is Status.PENDING:
            self.behind = True  # the driver has not caught up: its threads need the GIL
        if idle and not self._wakes:  # it sleeps long: wake it (awake, it polls every POLL_S)
            with self._cond:
                self._cond.notify()

    def _timed(self, began: float, call: str) -> None:
        """A driver ``call`` ("post", "poll") made on the control thread ended: ``SLOW_POSTS``
        slow ones of a kind in a row send both kinds to the worker for ``SLOW_S``."""
        slow = self._slow_calls
        if time.monotonic() - began <= INLINE_S:
            slow[call] = 0
        elif slow[call] + 1 < SLOW_POSTS:
            slow[call] += 1
        else:  # this driver works inside its calls
            slow[call], self._slow_until = 0, time.monotonic() + SLOW_S

    def _kick(self, wid: int) -> None:
        """Write ``wid``'s driver says a batch of it ended (on the driver's thread). The
        control thread polls it (``poll_kicked``): one hand-over, where waking the worker
        to poll it and report made two, and cost a pipelined burst of one-page requests a
        twelfth of its rate. While the driver's calls are slow (``SLOW_POSTS``) the worker
        polls it instead."""
        with self._cond:
            self._kicked.add(wid)
            if time.monotonic() < self._slow_until:
                self._cond.notify()  # the worker polls the writes no report asked for
                return
            if self._asked:  # the control thread polls every kicked write at once
                return
            self._asked = True
        self.report(("kicked",))

    def poll_kicked(self) -> list[tuple[int, str, float]]:
        """Poll the writes whose driver said a batch ended, on the calling (control) thread:
        such a driver's poll reads a status, and a batch a write posts next (the notified
        last one of a split write) is a post as small ones are inline."""
        began = time.monotonic()
        with self._cond:
            kicked, self._kicked, self._asked = self._kicked, set(), False
        ended = self._ended(kicked)
        self._timed(began, "poll")
        return ended

    @property
    def backlog(self) -> bool:
        """Actions handed over that the worker has not taken yet."""
        return bool(self._queue)

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
        name_thread("xk-data")
        poll_at = 0.0
        while True:
            with self._cond:
                if not self._queue and not (self._kicked and not self._asked):
                    if self._stopping and not self._inflight:
                        return
                    now = time.monotonic()
                    if self._inflight:  # those that wake us are polled for deadlines only
                        left = (poll_at if self._polled else poll_at + CHECK_S) - now
                    else:  # just after work: wake often, so a write posted inline is seen soon
                        left = POLL_S if now < self._awake_until else 0.05
                    if left > 0:
                        asleep = time.monotonic()
                        self._cond.wait(left)
                        over = time.monotonic() - asleep - left
                        if over > STALL_S:  # the process was stopped (SIGSTOP, a frozen VM)
                            self._stall = (asleep, over)
                todo = list(self._queue)
                self._queue.clear()
                kicked: set[int] = set()
                if not self._asked:  # kicked while the driver's calls were slow: polled here
                    kicked, self._kicked = self._kicked, set()
            for action in todo:
                try:
                    self._do(action)
                except Exception:  # a bug: logged, and the loop goes on
                    log.exception("data plane: %s failed", type(action).__name__)
            now = time.monotonic()
            if self._polled or (todo and not self._wakes):
                self._awake_until = now + AWAKE_S
            due = poll_at if self._polled else poll_at + CHECK_S
            if self._inflight and now >= due:
                # While posts keep coming, poll a quarter as often: polling every write costs
                # the GIL the driver's own threads need to move the bytes. The pause counts
                # from the end of a poll (one of a write split in thousands of batches takes
                # milliseconds: counted from its start, the worker polled without pause).
                every = 4 * POLL_S if self._posted else POLL_S
                self._posted = False
                # Those whose driver wakes us, only once old: their deadline (their end
                # reaches the control thread, which polls them at once, see ``_kick``).
                young = now - CHECK_S
                with self._cond:
                    due_now = [
                        w for w, t in self._inflight.items()
                        if w in self._polled or w in self._cancelled or t.posted_at < young
                    ]  # fmt: skip
                self._poll(kicked.union(due_now))  # those taken above too: no one else will
                poll_at = time.monotonic() + every
            elif kicked:
                self._poll(kicked)

    def _do(self, action: act.Action) -> None:
        if isinstance(action, act.Post):
            start, length = self._stall
            if action.made < start and length > action.horizon:
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
            with self._cond:  # polled until its driver says it will wake us
                self._inflight[action.wid] = t
                self._polled.add(action.wid)
            self._wakes = t.wake_on_end(functools.partial(self._kick, action.wid))
            if self._wakes:
                with self._cond:
                    self._polled.discard(action.wid)
            self._posted = True
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
        elif isinstance(action, act.Fence):
            try:
                self.backend.fence(action.source)
            except XferError as exc:
                self.report(("fenced", action.source, str(exc), b""))
                return
            self.report(("fenced", action.source, "", self.backend.endpoint()))
        elif isinstance(action, act.Disconnect):
            try:
                self.backend.disconnect(action.peer)
            except XferError as exc:
                log.warning("data plane: disconnecting %s: %s", action.peer, exc)

    def _poll(self, wids: Iterable[int]) -> None:
        ended = self._ended(wids)
        if ended:  # one event for the poll: one wake-up, one pass of the core
            self.report(("writes_ended", ended))

    def _ended(self, wids: Iterable[int]) -> list[tuple[int, str, float]]:
        """Poll ``wids`` (from either thread); those that ended leave ``_inflight``, each
        reported by whichever thread saw it first."""
        now = time.monotonic()
        with self._cond:
            inflight = [(w, t) for w in list(wids) if (t := self._inflight.get(w)) is not None]
        ended: list[tuple[int, str, float]] = []
        for wid, t in inflight:
            st = t.poll()
            if st is Status.PENDING:
                limit = self._cancelled.get(wid)
                if limit is not None and now > limit:  # said once; it stays in flight
                    log.error("write %d: aborted, still in the driver after %s s", wid, DRAIN_S)
                    self._cancelled[wid] = float("inf")
                continue
            with self._cond:
                if self._inflight.pop(wid, None) is None:
                    continue  # the other thread saw it end first
                self._polled.discard(wid)
            self._cancelled.pop(wid, None)
            ended.append((wid, "" if st is Status.DONE else str(t.error), t.post_s))
        return ended
