"""Where a one-page request's time goes, hop by hop, across the two processes.

``bench_session.py``'s pair (a prefill process, this decode process, the loopback), its
one-by-one requests (the prefill offered and wrote first), with a timestamp taken at the
same calls in both processes (``perf_counter_ns``: one clock for both): the engine's
``Session.expect`` and ``Receive.wait``, each side's ``zmq.Poller.poll`` return (its
control thread woke), ``Backend.write``, the loopback's copy and notification, and
``Backend.notifications``. Each request's hops are the first of each mark after the
previous one (a request whose marks do not all come in that order is left out: the
``requests`` column); the table gives their medians. Only public entry points and the loopback's
own are wrapped, so the same script measures older code (``PYTHONPATH`` naming its SDK
and loopback plugin first). The wrapping itself adds about a tenth.

Prints a table and writes benchmarks/results/hops.json.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import bench_session
import zmq
from report import Column, parser, save, table

import xferkit
from xferkit import Backend
from xferkit.session import Receive, Session

Mark = tuple[int, str, int]  # (perf_counter_ns, what, thread)
MARKS: list[Mark] = []

HOPS = [
    ("D", "expect", "Session.expect called (decode, engine thread)"),
    ("D", "expected", "-> Session.expect returned"),
    ("P", "woke", "-> the prefill's control thread wakes (the Request over TCP)"),
    ("P", "write", "-> Backend.write called (prefill control thread: the core, the plan)"),
    ("P", "wrote", "-> Backend.write returned"),
    ("P", "copy", "-> the loopback's copy starts (its worker took the GIL)"),
    ("P", "notify", "-> the copy ended, the notification goes out"),
    ("P", "notified", "-> the notification went out"),
    ("D", "woke", "-> the decode's control thread wakes"),
    ("D", "notes", "-> Backend.notifications called"),
    ("D", "waited", "-> Receive.wait returns (the core, the handle, the engine's wake)"),
]


def _wrap(cls: Any, name: str, before: str, after: str | None = None) -> None:
    orig: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            MARKS.append((time.perf_counter_ns(), before, threading.get_ident()))
        out = orig(*args, **kwargs)
        if after:
            MARKS.append((time.perf_counter_ns(), after, threading.get_ident()))
        return out

    setattr(cls, name, wrapped)


def install() -> None:
    """Timestamps at the hops, in this process (both run it)."""
    import xferkit_loopback.backend as loopback
    from xferkit_loopback.notices import Mailbox

    driver = next(
        v for v in vars(loopback).values() if isinstance(v, type) and "_execute" in vars(v)
    )
    _wrap(Session, "expect", "expect", "expected")
    _wrap(Receive, "wait", "", "waited")
    _wrap(Backend, "write", "write", "wrote")
    _wrap(Backend, "notifications", "notes")
    _wrap(zmq.Poller, "poll", "", "woke")
    _wrap(driver, "_execute", "copy")
    _wrap(Mailbox, "send", "notify", "notified")


def prefill(conn: Connection) -> None:
    install()
    try:
        bench_session.prefill(conn)
    finally:
        conn.send(MARKS)


def hops(requests: int) -> list[dict[str, Any]]:
    install()
    bench_session.prefill = prefill  # the pair's child process runs this one
    pair = bench_session.Pair("loopback", 8)
    pair.one_by_one(50, [1], [2])  # warm
    MARKS.clear()
    pair.one_by_one(requests, [1], [2])
    pair.conn.send(("quit",))
    theirs: list[Mark] = pair.conn.recv()
    pair.proc.join(30)
    pair.session.close()
    events = sorted([(t, "D", n) for t, n, _ in MARKS] + [(t, "P", n) for t, n, _ in theirs])
    spans: dict[str, list[float]] = {h[2]: [] for h in HOPS[1:]}
    starts = [i for i, e in enumerate(events) if e[1:] == ("D", "expect")]
    for a, b in zip(starts, [*starts[1:], len(events)], strict=True):
        got, at, prev = {}, a + 1, events[a][0]
        for side, name, what in HOPS[1:]:
            while at < b and events[at][1:] != (side, name):
                at += 1
            if at == b:
                break
            got[what], prev = (events[at][0] - prev) / 1e3, events[at][0]
            at += 1
        if len(got) == len(spans):
            for what, us in got.items():
                spans[what].append(us)
    rows = [{"hop": what, "us": statistics.median(v), "n": len(v)} for what, v in spans.items()]
    total = sum(statistics.median(v) for v in spans.values())
    return [*rows, {"hop": "total (medians summed)", "us": total, "n": rows[0]["n"]}]


def main() -> None:
    args = parser("hops", __doc__)
    args.add_argument("--requests", type=int, default=500)
    a = args.parse_args()
    mp.set_start_method("spawn", force=True)
    rows = hops(a.requests)
    table(rows, [Column("hop", "hop", width=72, left=True), Column("us", "us", ".0f", 8),
                 Column("requests", "n", "", 9)])  # fmt: skip
    save(a.out, rows, requests=a.requests, sdk=os.path.dirname(xferkit.__file__))


if __name__ == "__main__":
    main()
