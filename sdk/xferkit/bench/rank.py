"""One rank process of ``xferkit bench``: its buffers, its Session, its requests.

Driven by the coordinator over a multiprocessing pipe (the ``spawn`` start
method: nothing of the parent's state is inherited). Requests end as an
engine's would see them: the Session's ``on_finished`` hook hands each
finished handle to one reporter thread, which checks a decode rank's bytes and
reports the request's times on this rank (``time.monotonic``: one clock for
every process of the host), its routes and its timeline. (A waiter thread per
request cost the ranks a fifth of their CPU at 200 requests in flight.)
SIGINT is ignored here: the coordinator ends ranks in order on Ctrl-C; a
vanished coordinator (EOF on the pipe) ends the rank too.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Literal

from ..errors import XferError
from ..plugins import open_backend
from ..session import Receive, Send, Session, SessionKeys, State
from ..testing.reference import RegionSpec
from ..threadname import name_thread
from .content import Checker
from .ranks import build_rank, stage_specs

Slots = dict[str, list[int]]


@dataclass(frozen=True)
class RankSetup:
    role: str  # "prefill" or "decode"
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    specs: list[RegionSpec]
    slots: dict[str, int]
    driver: str
    options: dict[str, Any] = field(default_factory=dict)
    session: dict[str, Any] = field(default_factory=dict)
    keys: tuple[bytes, bytes] | None = None
    verify: bool = True
    debug: bool = False


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Rank:
    def __init__(self, conn: Connection, setup: RankSetup) -> None:
        self.conn, self.setup = conn, setup
        self._lock = threading.Lock()
        side: Literal["src", "dst"] = "src" if setup.role == "prefill" else "dst"
        self.rank = build_rank(
            setup.specs,
            side,
            tp_rank=setup.tp_rank,
            tp_size=setup.tp_size,
            pp_rank=setup.pp_rank,
            pp_size=setup.pp_size,
            slots=setup.slots,
        )
        mine = stage_specs(setup.specs, setup.pp_rank, setup.pp_size)
        self.checker = Checker(mine, setup.tp_rank, setup.tp_size)
        keys = (
            None
            if setup.keys is None
            else SessionKeys(setup.keys[0], setup.keys[1], [setup.keys[0]])
        )
        stages: dict[str, Any] = {}
        if side == "dst":
            stages = {"pp_rank": setup.pp_rank, "pp_size": setup.pp_size}
        # rid -> (started, check), until reported; filled before the request begins
        self._pending: dict[str, tuple[float, dict | None]] = {}
        self._finished: queue.SimpleQueue[Receive | Send | None] = queue.SimpleQueue()
        self._reporter = threading.Thread(target=self._report, name="bench-reporter", daemon=True)
        self._reporter.start()
        self.session = Session(
            open_backend(setup.driver, **setup.options),
            self.rank.manifest,
            keys=keys,
            on_finished=self._finished.put,  # on the control thread: only hand it over
            **stages,
            **setup.session,
        )

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def start(self, rid: str, begin: Any, check: dict | None = None) -> None:
        started = time.monotonic()
        self._pending[rid] = (started, check)
        try:
            begin()
        except XferError as exc:
            del self._pending[rid]
            ended, routes = time.monotonic(), (0, 0, 0.0, 0, 0)
            self.send(("done", rid, started, ended, _text(exc), None, routes, {}, {}))

    def _report(self) -> None:
        name_thread("bench-reporter")
        while (handle := self._finished.get()) is not None:
            try:
                self._done(handle)
            except Exception as exc:  # a bug: tell the coordinator rather than hang it
                self.send(("error", _text(exc), traceback.format_exc()))

    def drained(self, timeout: float) -> bool:
        """Every request begun here was reported (what an audit waits for)."""
        limit = time.monotonic() + timeout
        while self._pending and time.monotonic() < limit:
            time.sleep(0.005)
        return not self._pending

    def _done(self, handle: Receive | Send) -> None:
        ended = max(handle.times.values())  # its DONE or FAILED, not when the reporter got to it
        rid = handle.request_id
        started, check = self._pending[rid]
        error = ""
        if handle.poll() is not State.DONE:
            error = str(handle.error or f"ended {handle.poll().name}")
        verified: str | bool | None = None
        if not error and check is not None and self.setup.verify:
            try:
                self.checker.check(self.rank.arrays, check)
                verified = True
            except AssertionError as exc:
                verified = str(exc)
            self.checker.reset(self.rank.arrays, check)
        r = handle.routes
        routes = (
            r.staged, r.direct, r.staging_wait_s, r.staged_bytes, r.direct_bytes, r.writes
        )  # fmt: skip
        times = {s.name: t for s, t in handle.times.items()}
        spans = {k: (s.start, s.end, s.busy) for k, s in handle.timeline.items()}
        del self._pending[rid]
        self.send(("done", rid, started, ended, error, verified, routes, times, spans))

    def serve(self) -> None:
        s = self.session
        while True:
            try:
                cmd = self.conn.recv()
            except (EOFError, OSError):
                return
            if cmd[0] == "quit":
                return
            if cmd[0] == "expect":
                _, rid, sources, slots, check = cmd
                self.start(rid, partial(s.expect, rid, sources, slots), check)
            elif cmd[0] == "audit":
                self.drained(10)  # every request's check and reset come first
                self.send(("audit", self.checker.audit(self.rank.arrays)))
            elif cmd[0] == "offer":
                _, rid, chunks = cmd
                self.start(rid, partial(_offer, s, rid, chunks))
            s.progress()  # finished ids accumulate until read

    def close(self) -> None:
        self.session.close()
        self._finished.put(None)
        self._reporter.join(5)


def _offer(session: Session, rid: str, chunks: list[Slots]) -> Send:
    send = session.offer(rid)
    for i, chunk in enumerate(chunks):
        send.write(chunk, last=i == len(chunks) - 1)
    return send


def serve(conn: Connection, setup: RankSetup) -> None:
    """The rank process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.DEBUG if setup.debug else logging.ERROR)
    try:
        rank = _Rank(conn, setup)
    except Exception as exc:
        conn.send(("error", _text(exc), traceback.format_exc()))
        return
    m = rank.rank.manifest
    dropped = [(d.key, d.reason) for d in m.dropped]
    conn.send(("ready", rank.session.address, m.encode(), dropped))
    try:
        rank.serve()
    finally:
        rank.close()
        with contextlib.suppress(OSError):
            conn.send(("bye",))
