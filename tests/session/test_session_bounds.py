"""What a hostile peer can make a Session hold (issue 17): memory, threads, descriptors.

Every bound is measured from /proc on the process running the Session (a
subprocess rank, so the test's own allocations do not count), never from the
Session's tables. Each failed before the control plane was rebuilt (issue 17).
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import procfs
from attacker import distinct_endpoint, hostile
from procfs import MIB
from session_rank import Check, Expect, Offer, RankProcess, Setup, Wait, Write, ranks, reference

import xferkit as xk
from xferkit.session import Session, wire
from xferkit.session.core import MAX_PAIRS

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 3.0}


def _honest(pre: RankProcess, dec: RankProcess, rid: str) -> None:
    dec.ok(Expect(rid, [pre.address], {"kv": [4, 5]}))
    pre.ok(Offer(rid))
    pre.ok(Write(rid, {"kv": [0, 1]}, last=True))
    got = dec.ok(Wait(rid, 5))
    assert got.state == "DONE", got
    dec.ok(Check({"kv": ([0, 1], [4, 5])}))


def _settled_rss(pid: int, seconds: float = 0.3) -> int:
    """RSS once it stops falling (freed buffers returned), sampled for at most ``seconds``."""
    low = procfs.rss(pid)
    limit = time.monotonic() + seconds
    while time.monotonic() < limit:
        time.sleep(0.05)
        low = min(low, procfs.rss(pid))
    return low


# -- 9: huge Requests for ids nobody offered ----------------------------------------------

REQUEST_GROWTH = 256 * MIB
"""The most a prefill rank's RSS may grow for two maximal Requests nobody offered."""
HUGE = 2  # each takes 2-5 s to decode here (more under load); two exceed the bound fourfold


def test_maximal_requests_for_ids_nobody_offered_hold_bounded_memory() -> None:
    """Defect: four 60 MiB Requests, each naming 15 pools of 4M slots (for ids nobody had
    offered), took a Session from 44 to 1,604 MiB (each slot list became an int64 array,
    held for request_timeout_s). Fixed: the Requests are refused or kept compact, so the
    prefill rank's RSS grows by at most REQUEST_GROWTH (256 MiB) for two of them (HUGE: four
    would spend ~9 s decoding alone); an honest request still works after them."""
    pools = {f"pool{i:02d}": [0] * wire.MAX_SLOTS for i in range(15)}
    # The prefill's dead_after_s is long: decoding one Request takes seconds, and the pair
    # must stay live (as a pinging peer keeps it) for what it made the prefill hold to count.
    patient = Setup("src", 0, 1, 1, session={**FAST, "dead_after_s": 60.0})
    with ranks(patient, Setup("dst", 0, 1, 1, session=FAST)) as (pre, dec), hostile() as a:
        conn = a.connect(pre.address)
        welcome = conn.hello()
        assert welcome is not None and not welcome.error, welcome
        assert conn.sync()
        before = _settled_rss(pre.proc.pid, 0.1)
        for i in range(HUGE):
            conn.request(f"huge{i}", pools)
        conn.sync(timeout=12)  # every Request handled (a refusing Session may stay silent)
        conn.ping()  # a live peer: what it made the prefill hold is held on
        grown = _settled_rss(pre.proc.pid) - before
        _honest(pre, dec, "after")
        assert grown <= REQUEST_GROWTH, f"RSS grew by {grown / MIB:.0f} MiB"


# -- 10: a failed handshake's Hello kept while the peer pings -----------------------------

HELLO_GROWTH = 96 * MIB
"""The most a prefill rank's RSS may stay above its baseline after eight refused 60 MiB
Hellos whose peers keep pinging."""


def test_a_refused_hello_is_not_kept_while_its_peer_pings() -> None:
    """Defect: a failed handshake kept the whole Hello (up to 64 MiB) for as long as the peer
    kept pinging: eight peers held about 480 MiB. Fixed: what a refused pair keeps is small,
    so the prefill rank's RSS stays within HELLO_GROWTH (96 MiB) of its baseline while
    the peers keep pinging."""
    junk = b"\xa5" * (60 * MIB)
    # Its dead_after_s is long, so a slow machine cannot lose the pairs between two pings.
    patient = Setup("src", 0, 1, 1, session={**FAST, "dead_after_s": 30.0})
    with ranks(patient) as (pre,), hostile() as a:
        before = _settled_rss(pre.proc.pid, 0.1)
        conns = [a.connect(pre.address) for _ in range(8)]
        for i, conn in enumerate(conns):
            reply = conn.hello(backend="no-such-backend", endpoint=junk)
            assert reply is not None and reply.error, reply  # refused
            for earlier in conns[:i]:  # the pairs refused so far stay alive
                earlier.ping()
        limit = time.monotonic() + 1.0
        while time.monotonic() < limit:  # the peers keep pinging
            for conn in conns:
                conn.ping()
            time.sleep(FAST["heartbeat_s"])
        grown = _settled_rss(pre.proc.pid) - before
        assert grown <= HELLO_GROWTH, f"RSS is {grown / MIB:.0f} MiB above its baseline"


# -- 11: a loopback link (thread + pidfd) per Hello -----------------------------------------

LINKS = MAX_PAIRS
"""The most driver links a Session may hold for peers at once (documented cap)."""
HELLOS = 300


def test_hellos_from_many_connections_hold_a_bounded_number_of_links() -> None:
    """Defect: every Hello made the loopback open a worker thread and a pidfd for its
    endpoint: 300 Hellos from distinct connections cost the prefill rank 300 threads and
    600 descriptors. Fixed: at most LINKS (MAX_PAIRS) links are held, so the prefill rank's threads
    grow by at most LINKS + 8 and its non-socket descriptors by at most LINKS + 16, while each
    connection still costs ZMQ its one TCP socket."""
    with (
        ranks(Setup("src", 0, 1, 1, session={**FAST, "dead_after_s": 30.0})) as (pre,),
        hostile() as a,
    ):
        assert a.backend is not None
        pid = pre.proc.pid
        base_threads, base_fds = procfs.threads(pid), procfs.fds(pid)
        conns = []
        for _ in range(HELLOS):
            endpoint, driver = distinct_endpoint(a.backend.endpoint())
            conn = a.connect(pre.address)
            conn.send(
                wire.Hello(**{**a.introduction(), "endpoint": endpoint, "driver_address": driver})
            )
            conns.append(conn)
        limit = time.monotonic() + 10  # every Hello answered (or 10 s, for a silent refusal)
        answered = sum(
            conn.next(wire.Welcome, max(0.0, limit - time.monotonic())) is not None
            for conn in conns
        )
        grown_threads = procfs.threads(pid) - base_threads
        fds = procfs.fds(pid)
        others = fds["all"] - fds["socket"] - (base_fds["all"] - base_fds["socket"])
        sockets = fds["socket"] - base_fds["socket"]
        grown = (
            f"{grown_threads} threads, {others} other fds, {sockets} sockets more for "
            f"{HELLOS} Hellos ({answered} answered)"
        )
        assert grown_threads <= LINKS + 8, grown
        assert others <= LINKS + 16, grown
        assert sockets <= HELLOS + 16, grown


# -- 12: a Session dropped without close() --------------------------------------------------


def test_a_session_dropped_without_close_is_reclaimed_with_a_warning() -> None:
    """Defect: a Session dropped without close() was never reclaimed: its I/O thread kept it
    alive (ten dropped Sessions held ten threads and 650 MiB). Fixed: after ``del`` and
    gc.collect() its threads end and a ResourceWarning names the leak. (In-process: the
    object's life is what is tested.)"""
    ref = reference(1, 1, seed=5)
    before = {t.ident for t in threading.enumerate()}
    sessions = [Session(xk.open_backend("loopback"), ref.srcs[0].manifest) for _ in range(3)]
    refs = [weakref.ref(s) for s in sessions]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del sessions
            gc.collect()
            limit = time.monotonic() + 5
            while time.monotonic() < limit and {t.ident for t in threading.enumerate()} - before:
                time.sleep(0.02)
                gc.collect()
        left = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not left, f"threads still running after the Sessions were dropped: {left}"
        assert all(r() is None for r in refs), "a dropped Session is still alive"
        leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(leaks) >= 3, [str(w.message) for w in caught]
    finally:
        for r in refs:  # still alive (the defect): close them, so nothing leaks past the test
            alive = r()
            if alive is not None:
                alive.close()
