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

Beside the hops, in the same run, what any control plane over ZMQ pays on this machine
(``floor``): one message between two processes (half a DEALER/ROUTER round trip over TCP
on 127.0.0.1, the receiver in ``zmq.Poller.poll`` as the Session's control thread is), a
thread in ``zmq.Poller.poll`` woken through a socketpair (how an engine's call reaches the
control thread), and a thread blocked on a lock woken by its release (how the end of a
request reaches the engine's ``wait``). A Session's request crosses each at least once
beyond a direct write, so their sum bounds from below what the control plane can cost here.

Prints a table and writes benchmarks/results/hops.json.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import socket
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


def _echo(conn: Connection) -> None:
    """A ROUTER that sends back whatever comes, until an empty message."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    conn.send(router.getsockopt_string(zmq.LAST_ENDPOINT))
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        poller.poll(10_000)
        ident, data = router.recv_multipart()
        if not data:
            break
        router.send_multipart([ident, data])
    router.close(0)
    ctx.term()


def _message_us(count: int) -> list[float]:
    """Half of each DEALER/ROUTER round trip to another process, in us."""
    here, there = mp.Pipe()
    proc = mp.Process(target=_echo, args=(there,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(here.recv())
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    payload = bytes(200)  # about a Request's size
    out = []
    for i in range(count + 50):
        t = time.perf_counter_ns()
        dealer.send(payload)
        poller.poll(10_000)
        dealer.recv()
        if i >= 50:  # warm
            out.append((time.perf_counter_ns() - t) / 2e3)
    dealer.send(b"")
    proc.join(10)
    dealer.close(0)
    ctx.term()
    return out


def _poll_wake_us(count: int) -> list[float]:
    """A thread in ``zmq.Poller.poll`` on a socketpair, woken by a byte: send to return."""
    r, w = socket.socketpair()
    poller = zmq.Poller()
    poller.register(r.fileno(), zmq.POLLIN)
    sent = [0]
    out: list[float] = []
    ready = threading.Event()

    def sleeper() -> None:
        for _ in range(count):
            ready.set()
            poller.poll(10_000)
            out.append((time.perf_counter_ns() - sent[0]) / 1e3)
            r.recv(16)

    t = threading.Thread(target=sleeper)
    t.start()
    for _ in range(count):
        ready.wait()
        ready.clear()
        time.sleep(2e-4)  # let it block in poll
        sent[0] = time.perf_counter_ns()
        w.send(b"\0")
    t.join()
    r.close()
    w.close()
    return out


def _lock_wake_us(count: int) -> list[float]:
    """A thread blocked on a lock, woken by its release: release to the acquire's return."""
    out: list[float] = []
    released = [0]
    for _ in range(count):
        gate = threading.Lock()
        gate.acquire()

        def waiter(g: threading.Lock = gate) -> None:
            g.acquire()
            out.append((time.perf_counter_ns() - released[0]) / 1e3)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(2e-4)  # let it block
        released[0] = time.perf_counter_ns()
        gate.release()
        t.join()
    return out


def floor(count: int) -> list[dict[str, Any]]:
    """What any ZMQ control plane pays here, measured beside the hops."""
    parts = [
        ("floor: one ZMQ message, process to process (half a round trip)", _message_us),
        ("floor: zmq.Poller.poll woken by a socketpair (engine -> control)", _poll_wake_us),
        ("floor: a lock's waiter woken by its release (control -> engine)", _lock_wake_us),
    ]
    us = [statistics.median(f(count)) for _, f in parts]
    rows = [{"hop": what, "us": t, "n": count} for (what, _), t in zip(parts, us, strict=True)]
    total = sum(us)
    return [*rows, {"hop": "floor: the three summed", "us": total, "n": count}]


def main() -> None:
    args = parser("hops", __doc__)
    args.add_argument("--requests", type=int, default=500)
    a = args.parse_args()
    mp.set_start_method("spawn", force=True)
    rows = hops(a.requests) + floor(a.requests)
    table(rows, [Column("hop", "hop", width=72, left=True), Column("us", "us", ".0f", 8),
                 Column("requests", "n", "", 9)])  # fmt: skip
    save(a.out, rows, requests=a.requests, sdk=os.path.dirname(xferkit.__file__))


if __name__ == "__main__":
    main()
