"""A careless caller's refused calls leave nothing behind: no thread, no descriptor, no
registration, and the same call with good arguments then works."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

import xferkit as xk
from xferkit.session import Receive, Send, Session


def _manifest() -> xk.Manifest:
    return xk.Manifest.build(
        [xk.Region.from_array(np.zeros((8, 16), np.uint8), pool="p", name="a", layer=0)]
    )


def _held() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _settled(before: tuple[int, int]) -> tuple[int, int]:
    """What this process holds once threads that are ending have ended (bounded)."""
    deadline = time.monotonic() + 5
    while _held() != before and time.monotonic() < deadline:
        time.sleep(0.02)
    return _held()


@pytest.mark.parametrize(
    "timeout", ["5", -1, 2**1024, np.array([1, 2]), None],
    ids=["str", "negative", "huge int", "array", "None"],
)  # fmt: skip
def test_a_close_with_a_bad_timeout_is_refused_before_anything_stops(timeout: object) -> None:
    """Before, close() marked the Session closed and then checked ``timeout``: the refusal
    left its threads, sockets and backend running for good (a second close did nothing)."""
    m = _manifest()
    before = _held()
    backend = xk.open_backend("loopback")
    s = Session(backend, m)
    with pytest.raises(xk.XferError, match="timeout"):
        s.close(timeout=timeout)  # type: ignore[arg-type]
    assert s.offer("still-open").poll() is not xk.State.FAILED  # nothing of it stopped
    s.close()
    with pytest.raises(xk.XferError, match="closed"):
        backend.endpoint()  # the Session closed it
    assert _settled(before) == before


@pytest.mark.parametrize(
    "options",
    [
        {"bind": "tcp://nohost.invalid:0"},
        {"bind": "tcp://:0"},
        {"group": "tcp://127.0.0.1:5|abc"},
        {"staging": np.array(["auto", "never"])},
        {"heartbeat_s": 2**1024},
        {"bind": "tcp://127.0.0.1:0\udcff"},
        {"group": "tcp://127.0.0.1:5\udcff"},
    ],
    ids=[
        "unknown host",
        "no host",
        "group key not trusted",
        "staging an array",
        "huge int",
        "bind cannot encode",
        "group cannot encode",
    ],
)
def test_a_refused_session_leaves_the_backend_as_it_was(options: dict[str, object]) -> None:
    """Before, a refused bind or group left the manifest registered (the next Session on that
    backend was refused: "another manifest registered"), a group refusal left the data-plane
    thread running, and the last two raised ValueError and OverflowError."""
    m = _manifest()
    before = _held()
    backend = xk.open_backend("loopback")
    try:
        with pytest.raises(xk.XferError):
            Session(backend, m, **options)  # type: ignore[arg-type]
        assert backend.manifest is None
        s = Session(backend, m)  # the same backend, good arguments
        s.close()
    finally:
        backend.close()
    assert _settled(before) == before


def test_sources_that_cannot_be_iterated_are_refused_naming_them() -> None:
    """A 0-d array is ``Iterable`` and raises when iterated: before, ``expect`` and ``renew``
    let that ``TypeError`` out."""
    with Session(xk.open_backend("loopback"), _manifest()) as s:
        for call in (
            lambda: s.expect("r", np.array(1), {"p": [0]}),
            lambda: s.renew("r", np.array(1)),
        ):
            with pytest.raises(xk.XferError, match="source="):
                call()
        s.expect("r", [s.address], {"p": [0]})  # the id was not taken by the refusals


class _ClosingSlots(dict):
    """Slots whose reading closes the Session: a close from another thread landing while
    ``expect`` or ``write`` checks its arguments, made deterministic."""

    session: Session | None = None

    def items(self):  # type: ignore[no-untyped-def]
        assert self.session is not None
        self.session.close()
        return super().items()


def test_a_call_racing_a_close_is_refused_not_left_unanswered() -> None:
    """Before, a call that found the Session open queued its command behind the close: the
    control thread had ended, nothing ran it, and the handle stayed HANDSHAKING for good
    (a busy engine closing while other threads call in left 3 of 5,383 handles so)."""
    m = _manifest()
    before = _held()
    s = Session(xk.open_backend("loopback"), m)
    slots = _ClosingSlots({"p": [0]})
    slots.session = s
    with pytest.raises(xk.XferError, match="closed"):
        s.expect("r", "tcp://127.0.0.1:1", slots)
    assert _settled(before) == before

    s = Session(xk.open_backend("loopback"), m)
    send = s.offer("w")
    slots = _ClosingSlots({"p": [1]})
    slots.session = s
    send.write(slots, last=True)  # the close failed it meanwhile: nothing more is written
    assert send.poll() is xk.State.FAILED
    send.abort()  # done already: answered, not refused
    assert _settled(before) == before


def test_a_close_that_outwaits_its_timeout_leaves_the_sockets_to_the_control_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine's hook holds the control thread past close()'s timeout. Before, close()
    then closed the sockets and the ZMQ context under the running thread, which went on
    using them (a busy engine's run logged a failure on every pass of the drain that
    followed: 220,749 lines). Now close() returns at its timeout with the backend closed
    (nothing lands after it returns), and the thread releases its sockets as it ends."""
    m = _manifest()
    before = _held()
    seen: list[str] = []

    def slow_hook(handle: object) -> None:
        time.sleep(2.0)  # past close()'s 0.5 s, and the second it used to wait on top
        router = s._shell.router  # what the thread goes on using once the hook returns
        seen.append("router closed" if router.closed else "router open")
        try:
            s.backend.endpoint()
            seen.append("backend open")
        except xk.XferError as exc:
            seen.append(f"backend: {exc}")

    s = Session(xk.open_backend("loopback"), m, on_finished=slow_hook)
    s.expect("r", "tcp://127.0.0.1:1", {"p": [0]})  # never paired: the close fails it at once
    with caplog.at_level(logging.WARNING, logger="xferkit"):
        began = time.monotonic()
        s.close(timeout=0.5)
        returned = time.monotonic() - began
        assert _settled(before) == before  # the thread released everything as it ended
    assert seen[0] == "router open"  # the thread's sockets are its own until it ends
    assert seen[1].startswith("backend:") and "closed" in seen[1]  # deregistered at once
    assert returned < 1.9  # close() kept its timeout, not the hook's 2 s
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("did not stop within 0.5 s" in m for m in said), said
    assert sum("draining notifications" in m for m in said) <= 1, said  # said once, not a flood


def test_a_close_from_the_sessions_own_hook_closes_it_once_the_hook_returns() -> None:
    """Before, close() inside ``on_finished`` (the control thread) tried to join its own
    thread: RuntimeError, the Session marked closed with its sockets, thread and backend
    left open for good, and the garbage collector later hung in the ZMQ context's term()."""
    m = _manifest()
    before = _held()
    ended: list[str] = []

    def hook(handle: Receive | Send) -> None:
        s.close()
        ended.append(handle.request_id)

    s = Session(xk.open_backend("loopback"), m, on_finished=hook)
    got = s.expect("r", "tcp://127.0.0.1:1", {"p": [0]})
    got.abort(0)  # FAILED at once (no source to confirm): the hook runs, and closes
    assert _settled(before) == before
    assert ended == ["r"]
    with pytest.raises(xk.XferError, match="closed"):
        s.offer("later")


@pytest.mark.parametrize("where", ["request id", "source"])
def test_text_that_cannot_travel_is_refused_at_the_call(where: str) -> None:
    """A lone surrogate cannot be encoded. Before, expect() took it; the control thread died
    encoding the first message naming it, and so did its crash handler: every handle of the
    Session stayed HANDSHAKING for good, and close() hung in the ZMQ context's term()."""
    m = _manifest()
    before = _held()
    with Session(xk.open_backend("loopback"), m) as s:
        rid, source = ("r\udcff", "tcp://127.0.0.1:1") if where == "request id" else (
            "r", "tcp://127.0.0.1:1\udcff"
        )  # fmt: skip
        with pytest.raises(xk.XferError, match=r"request id|source="):
            s.expect(rid, source, {"p": [0]})
        if where == "request id":
            with pytest.raises(xk.XferError, match="request id"):
                s.offer(rid)
        s.expect("ok", "tcp://127.0.0.1:1", {"p": [0]}).abort(0)  # the Session still works
    assert _settled(before) == before


def test_of_two_last_writes_racing_on_one_handle_one_is_refused() -> None:
    """``write(last=True)`` checked and set its handle's last flag in two steps. Before, two
    threads could both pass (2-4 of 8 in a quarter of the trials under a fine switch
    interval), and the two sides then disagreed. Here the second write runs inside the
    first's slot check, deterministically."""
    m = _manifest()
    with Session(xk.open_backend("loopback"), m) as s:
        send = s.offer("w")

        class Racing(dict):  # the second write lands while the first checks its slots
            def items(self):  # type: ignore[no-untyped-def]
                send.write({"p": [2]}, last=True)
                return super().items()

        with pytest.raises(xk.XferError, match="after the last chunk"):
            send.write(Racing({"p": [1]}), last=True)
