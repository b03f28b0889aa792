"""A Transfer as the engine holds it: abort, wait, and polls from several threads."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mock_pairs import WAIT_S, Pair, buffer, descs, drain, manifest, mock_pair, posted

import xferkit as xk
from xferkit import Status, TransferError, XferError
from xferkit.driver import Posted
from xferkit.testing.mock import STALL, Call, MockDriver
from xferkit.testing.pairs import connected_pair
from xferkit.transfer import STATUS, Phase


def _stalling(call: Call) -> str | None:
    return STALL if call.op == "post" and call.count == 1 else None


def test_abort_ends_a_pending_write_as_failed_and_posts_nothing_more() -> None:
    with mock_pair(_stalling, max_batch=2, notifications=True) as pair:
        before = pair.dst.copy()
        t = pair.a.write(pair.peer, pair.descs(5, 64)[0], notify=b"never")
        assert t.poll() is Status.PENDING and len(posted(pair.a)) == 2
        t.abort()
        assert t.poll() is Status.FAILED
        assert isinstance(t.error, TransferError)
        assert "aborted by the caller" in str(t.error) and pair.peer.name in str(t.error)
        with pytest.raises(TransferError, match="aborted by the caller"):
            t.wait(WAIT_S)
        assert len(posted(pair.a)) == 2  # the notified batch never went out
        assert pair.b.notifications() == []
        t.abort("again")  # a terminal state is final
        assert "again" not in str(t.error)
        # The second batch (done) landed; the stalled first never did.
        assert not np.array_equal(pair.dst, before)
        # An aborted transfer is no longer in flight: close has nothing to wait for.
        start = time.monotonic()
        pair.a.close()
        assert time.monotonic() - start < 1


def test_abort_after_done_changes_nothing() -> None:
    with mock_pair() as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        t.wait(WAIT_S)
        t.abort("too late")
        assert t.poll() is Status.DONE and t.error is None


@pytest.mark.parametrize("timeout", [-1, "1", float("nan")])
def test_wait_refuses_a_bad_timeout(timeout: object) -> None:
    with mock_pair(_stalling) as pair:
        t = pair.a.write(pair.peer, pair.descs(1, 64)[0])
        with pytest.raises(XferError, match="timeout"):
            t.wait(timeout)  # type: ignore[arg-type]


def test_a_transfer_reports_its_size() -> None:
    with mock_pair() as pair:
        t = pair.a.write(pair.peer, pair.descs(3, 100)[0])
        assert (t.count, t.nbytes) == (3, 300)
        assert t.peer is pair.peer


def _poll_until_done(t: xk.Transfer, start: threading.Barrier, errors: list[BaseException]) -> None:
    start.wait()
    try:
        deadline = time.monotonic() + WAIT_S
        while t.poll() is Status.PENDING and time.monotonic() < deadline:
            pass
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Switch threads every microsecond: races show up instead of hiding behind the GIL."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("frequent_switches")
def test_polls_from_several_threads_post_the_notified_batch_once() -> None:
    """Threads race to post the last batch when the others complete: exactly one may.

    The loopback completes batches on its own worker thread, so the moment the
    last batch becomes due arrives while the pollers spin (the mock completes
    at once, inside ``write``, leaving nothing to race for).
    """
    threads_n, rounds = 8, 20
    with xk.open_backend("loopback", max_batch=1) as a, xk.open_backend("loopback") as b:
        src, dst = buffer(1 << 14, 1), buffer(1 << 14, 2)
        a.register(manifest([src], "src"))
        b.register(manifest([dst], "dst"))
        assert b.manifest is not None
        peer = a.connect(b.endpoint(), b.manifest)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        for r in range(rounds):
            dst[:] = 0
            t = a.write(
                peer,
                descs(
                    [s0 + 64 * i for i in range(16)], [d0 + 64 * i for i in range(16)], [64] * 16
                ),
                notify=b"r%d" % r,
            )
            start = threading.Barrier(threads_n)
            errors: list[BaseException] = []
            pollers = [
                threading.Thread(target=_poll_until_done, args=(t, start, errors))
                for _ in range(threads_n)
            ]
            for p in pollers:
                p.start()
            for p in pollers:
                p.join()
            assert errors == []
            assert t.poll() is Status.DONE and t.error is None
            np.testing.assert_array_equal(dst[: 64 * 16], src[: 64 * 16])
            notes = drain(b, 1)
            time.sleep(0.01)
            notes += b.notifications()
            assert [n.message for n in notes] == [b"r%d" % r]  # one notified batch, one message


def test_abort_without_waiting_returns_at_once_and_fails_when_drained() -> None:
    from xferkit.testing.mock import STALL

    def stall(call: Call) -> str | None:
        return STALL if call.op == "post" else None

    with mock_pair(stall) as p:
        d, _ = p.descs(1, 16)
        t = p.a.write(p.peer, d)
        t.abort("engine loop", wait=False)
        assert t.poll() is Status.FAILED  # the mock lets go on release
        assert t.error is not None and "engine loop" in str(t.error)


def test_a_split_write_without_a_notification_posts_every_batch_at_once() -> None:
    """Before: with max_batch=1 and the first batch stalled, only 3 of 4 batches went out:
    the last waited for the others although nothing rode on it."""
    with mock_pair(_stalling, max_batch=1) as pair:
        t = pair.a.write(pair.peer, pair.descs(4, 64)[0])
        assert t.poll() is Status.PENDING and t.phase is Phase.SENDING
        assert [len(c.descs) for c in posted(pair.a)] == [1, 1, 1, 1]
        t.abort()
        assert t.phase is Phase.FAILED and t.poll() is Status.FAILED


def test_a_notified_split_write_holds_its_last_batch_until_the_others_are_done() -> None:
    with mock_pair(_stalling, max_batch=1, notifications=True) as pair:
        t = pair.a.write(pair.peer, pair.descs(4, 64)[0], notify=b"last")
        assert t.poll() is Status.PENDING
        assert [c.message for c in posted(pair.a)] == [None, None, None]
        t.abort()
        assert pair.b.notifications() == []


class _Held(Posted):
    """A batch the engine keeps running after its release, until the test lets go."""

    def __init__(self) -> None:
        self.gone = False

    def poll(self) -> Status:
        return Status.FAILED if self.gone else Status.PENDING

    @property
    def error(self) -> str:
        return "let go"


def _first_post_fails(call: Call) -> str | None:
    return "link down" if call.op == "post" and call.count == 1 else None


class _HoldingDriver(MockDriver):
    """A MockDriver whose second post stays PENDING after release (an engine still DMA-ing)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(
            lambda c: "link down" if c.op == "post" and c.count == 1 else None, **options
        )
        self.held = _Held()

    def post(self, link: Any, descs: xk.Descriptors, notify: bytes | None) -> Posted:
        posted_ = super().post(link, descs, notify)
        return self.held if len(self.handles) == 2 else posted_


@pytest.mark.parametrize("notify", [None, b"n"])
def test_phases_run_sending_failing_failed_and_status_follows(notify: bytes | None) -> None:
    """A failed batch beside one the driver still holds: FAILING (error set, PENDING) until
    the driver lets go of it, then FAILED; DONE when nothing fails."""
    options: dict[str, Any] = {"max_batch": 1, "notifications": notify is not None}
    driver = _HoldingDriver(**options)
    with xk.Backend(driver) as a, xk.Backend(MockDriver(**options)) as b:
        src, dst = buffer(1 << 12, 1), buffer(1 << 12, 2)
        a.register(manifest([src], "src"))
        b.register(manifest([dst], "dst"))
        assert b.manifest is not None
        peer = a.connect(b.endpoint(), b.manifest)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        copies = descs([s0, s0 + 64, s0 + 128], [d0, d0 + 64, d0 + 128], [64] * 3)
        t = a.write(peer, copies, notify=notify)
        assert t.error is not None and "link down" in str(t.error)
        assert t.phase is Phase.FAILING and t.poll() is Status.PENDING
        driver.held.gone = True
        assert t.poll() is Status.FAILED and t.phase is Phase.FAILED
        assert STATUS[t.phase] is Status.FAILED
    with mock_pair(**options) as pair:
        t = pair.a.write(pair.peer, pair.descs(3, 64)[0], notify=notify)
        t.wait(WAIT_S)
        assert t.phase is Phase.DONE and t.poll() is Status.DONE


# -- a driver that says when a batch ended (Posted.on_end) ------------------------------------


def test_a_write_wakes_its_caller_as_its_batches_end_on_a_driver_that_says_so() -> None:
    """The loopback's batches end on its worker thread, which calls the hook: the Session's
    data plane sleeps until then instead of polling every millisecond."""
    loopback = functools.partial(xk.open_backend, "loopback", max_batch=2)
    with connected_pair(loopback, [buffer(4096, 1)], [buffer(4096, 2)]) as p:
        pair = Pair(p.a, p.b, p.srcs, p.dsts, p.peer, p.endpoint)
        d, want = pair.descs(6, 64)  # 3 batches, the notification on the last
        woken = threading.Event()
        t = pair.a.write(pair.peer, d, notify=b"done")
        assert t.wake_on_end(woken.set) is True and t.wakes
        while t.poll() is Status.PENDING:  # each wake-up moves it on: the next batches go
            assert woken.wait(WAIT_S), "a batch ended and nobody was told"
            woken.clear()
        assert t.poll() is Status.DONE and np.array_equal(pair.dst, want)
        ended = threading.Event()
        assert t.wake_on_end(ended.set) is True and ended.is_set()  # ended already: at once


def test_a_write_on_a_driver_without_the_hook_says_it_must_be_polled() -> None:
    with mock_pair(_stalling) as pair:
        t = pair.a.write(pair.peer, pair.descs(1, 64)[0])
        called: list[int] = []
        assert t.wake_on_end(lambda: called.append(1)) is False and not t.wakes
        t.abort()
        assert t.poll() is Status.FAILED and called == []


def test_a_hook_that_raises_counts_as_none() -> None:
    class Raising(Posted):
        def poll(self) -> Status:
            return Status.PENDING

        @property
        def error(self) -> str:
            return ""

        def on_end(self, wake: Any) -> bool:
            raise RuntimeError("driver bug")

    from xferkit.guarded import guard

    assert guard("drv", "post", Raising()).on_end(lambda: None) is False
