"""One rank process of ``xferkit bench``: its buffers, its Session, its requests.

Driven by the coordinator over a multiprocessing pipe (the ``spawn`` start
method: nothing of the parent's state is inherited). Each request runs on its
own waiter thread, which times it on this rank (``time.monotonic``: one clock
for every process of the host), checks a decode rank's bytes once it is DONE
and reports. SIGINT is ignored here: the coordinator ends ranks in order on
Ctrl-C; a vanished coordinator (EOF on the pipe) ends the rank too.
"""

from __future__ import annotations

import contextlib
import logging
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
        self.session = Session(
            open_backend(setup.driver, **setup.options),
            self.rank.manifest,
            keys=keys,
            **stages,
            **setup.session,
        )
        self.threads: list[threading.Thread] = []

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def start(self, rid: str, begin: Any, check: dict | None = None) -> None:
        started = time.monotonic()
        try:
            handle = begin()
        except XferError as exc:
            ended, routes = time.monotonic(), (0, 0, 0.0, 0, 0)
            self.send(("done", rid, started, ended, _text(exc), None, routes, {}))
            return
        t = threading.Thread(target=self._wait, args=(rid, handle, started, check), daemon=True)
        t.start()
        self.threads = [x for x in self.threads if x.is_alive()] + [t]

    def _wait(self, rid: str, handle: Receive | Send, started: float, check: dict | None) -> None:
        error = ""
        try:
            state = handle.wait(self.setup.session.get("request_timeout_s", 60.0) + 30.0)
            if state is not State.DONE:
                error = f"ended {state.name}"
        except XferError as exc:
            error = str(handle.error or exc)
        ended = time.monotonic()
        verified: str | bool | None = None
        if not error and check is not None and self.setup.verify:
            try:
                self.checker.check(self.rank.arrays, check)
                verified = True
            except AssertionError as exc:
                verified = str(exc)
            self.checker.reset(self.rank.arrays, check)
        r = handle.routes
        routes = (r.staged, r.direct, r.staging_wait_s, r.staged_bytes, r.direct_bytes)
        times = {s.name: t for s, t in handle.times.items()}
        self.send(("done", rid, started, ended, error, verified, routes, times))

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
                for t in self.threads:
                    t.join(10)  # every request's check and reset come first
                self.send(("audit", self.checker.audit(self.rank.arrays)))
            elif cmd[0] == "offer":
                _, rid, chunks = cmd
                self.start(rid, partial(_offer, s, rid, chunks))
            s.progress()  # finished ids accumulate until read

    def close(self) -> None:
        self.session.close()
        for t in self.threads:
            t.join(5)


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
