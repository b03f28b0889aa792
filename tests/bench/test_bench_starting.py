"""Waiting for a rank to start (``bench.starting``), against real child processes: a rank
faulting its pools in is waited for past the stall bound, a stuck one is not, and the cap
holds whatever the rank does."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

from xferkit.bench.starting import resident_bytes, wait_start

GROW = 32 << 20


def _grows_then_answers(conn: Connection, steps: int) -> None:
    held = []
    for _ in range(steps):
        held.append(b"\x01" * GROW)  # touched: resident
        time.sleep(0.15)
    conn.send("ready")
    time.sleep(5)


def _sleeps(conn: Connection, steps: int) -> None:
    time.sleep(10)


@contextmanager
def _child(target: Callable[[Connection, int], None], steps: int = 0) -> Iterator[tuple]:
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=target, args=(theirs, steps), daemon=True)
    proc.start()
    try:
        yield ours, proc
    finally:
        proc.kill()
        proc.join(5)


def test_a_rank_whose_memory_grows_is_waited_for_past_the_stall_bound() -> None:
    with _child(_grows_then_answers, steps=12) as (conn, proc):  # about 1.8 s of growth
        began = time.monotonic()
        assert wait_start(conn, proc, stall_s=0.6, cap_s=30) is None
        assert time.monotonic() - began > 0.6  # a fixed 0.6 s deadline would have failed it
        assert conn.recv() == "ready"
        assert resident_bytes(proc.pid) >= 12 * GROW


def test_a_rank_that_neither_answers_nor_grows_is_given_up_on_after_the_stall_bound() -> None:
    with _child(_sleeps) as (conn, proc):
        began = time.monotonic()
        why = wait_start(conn, proc, stall_s=0.5, cap_s=30)
        took = time.monotonic() - began
    assert why is not None and why.endswith("not growing for the last 0.5 s"), why
    assert 0.5 <= took < 5, took


def test_the_cap_holds_however_the_rank_grows() -> None:
    with _child(_grows_then_answers, steps=200) as (conn, proc):
        began = time.monotonic()
        why = wait_start(conn, proc, stall_s=0.6, cap_s=1.2)
        took = time.monotonic() - began
    assert why == "did not answer within 1.2 s", why
    assert 1.2 <= took < 5, took


def _exits(conn: Connection, steps: int) -> None:
    time.sleep(0.3)


def test_a_rank_that_exits_without_answering_is_reported_at_once() -> None:
    """Its end of the pipe may stay open in the parent: no EOF would tell."""
    with _child(_exits) as (conn, proc):
        began = time.monotonic()
        why = wait_start(conn, proc, stall_s=30, cap_s=60)
        took = time.monotonic() - began
    assert why == "exited (code 0) before it answered", why
    assert took < 5, took


def test_a_process_that_is_gone_reads_as_no_memory() -> None:
    with _child(_sleeps) as (_, proc):
        pid = proc.pid
        assert resident_bytes(pid) > 0
    assert resident_bytes(pid) == 0 and resident_bytes(None) == 0
