"""A handle's waits, as the engine's threads see them: every waiter goes on at the end (DONE or
FAILED), a wait past its timeout raises and leaves nothing behind, and the times say the
request went through TRANSFERRING even when the core said DONE at its first completion."""

from __future__ import annotations

import math
import threading
import time

import pytest

from xferkit import open_backend
from xferkit.errors import XferError
from xferkit.session import Session
from xferkit.session.handles import Receive
from xferkit.session.states import RequestError, State
from xferkit.testing import Reference, gdn_hybrid


class _Owner:
    def __init__(self) -> None:
        self.finished: list[object] = []

    def _finished(self, handle: object) -> None:
        self.finished.append(handle)


def _waiters(handle: Receive, count: int) -> tuple[list[threading.Thread], list[object]]:
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(handle.wait(10))
        except XferError as exc:
            got.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(count)]
    for t in threads:
        t.start()
    limit = time.monotonic() + 5
    while time.monotonic() < limit:  # every waiter is parked at its gate
        with handle._lock:
            if handle._gates is not None and len(handle._gates) == count:
                break
        time.sleep(0.001)
    return threads, got


def test_every_waiter_goes_on_at_done() -> None:
    owner = _Owner()
    h = Receive(owner, "r")  # type: ignore[arg-type]
    threads, got = _waiters(h, 3)
    h._move(State.WAITING)
    h._done()
    for t in threads:
        t.join(5)
    assert got == [State.DONE] * 3
    assert owner.finished == [h]
    times = h.times
    assert list(times) == [State.HANDSHAKING, State.WAITING, State.TRANSFERRING, State.DONE]
    assert times[State.TRANSFERRING] == times[State.DONE]


def test_every_waiter_reads_the_root_cause_at_failed() -> None:
    h = Receive(_Owner(), "r")  # type: ignore[arg-type]
    threads, got = _waiters(h, 2)
    error = RequestError("the root cause", stage="abort", request_id="r")
    assert h._fail(error)
    for t in threads:
        t.join(5)
    assert got == [error, error]


def test_a_wait_past_its_timeout_raises_and_leaves_no_gate() -> None:
    h = Receive(_Owner(), "r")  # type: ignore[arg-type]
    began = time.monotonic()
    with pytest.raises(XferError, match=r"still HANDSHAKING after 0\.05 s"):
        h.wait(0.05)
    assert time.monotonic() - began >= 0.05
    assert not h._gates  # nothing is left for the end to open
    h._done()
    assert h.wait(0) is State.DONE


@pytest.mark.parametrize("timeout", [math.inf, 1e300, None])
def test_a_wait_without_a_bound_waits_for_the_end(timeout: float | None) -> None:
    """``wait(math.inf)`` is an engine's "forever": it raised OverflowError (past what a
    lock's timeout takes) instead of waiting."""
    h = Receive(_Owner(), "r")  # type: ignore[arg-type]
    threading.Timer(0.05, h._done).start()
    assert h.wait(timeout) is State.DONE


def test_a_session_closed_without_a_bound_closes() -> None:
    """``close(timeout=math.inf)`` raised OverflowError from the control thread's join."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots={"kv": 4, "state": 2},
                    dst_slots={"kv": 4, "state": 2})  # fmt: skip
    session = Session(open_backend("loopback"), ref.srcs[0].manifest)
    session.close(timeout=math.inf)
    with pytest.raises(XferError, match="is closed"):
        session.offer("r")
