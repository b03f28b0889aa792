"""Writes: split to the driver's batch limit, notified last, the first failure reported."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from mock_pairs import WAIT_S, drain, mock_pair, posted

from xferkit import Descriptors, Status, TransferError
from xferkit.testing.mock import STALL, Call


@pytest.mark.parametrize(("count", "max_batch"), [(10, 3), (9, 3), (1, 4), (7, 1), (5, 8), (6, 0)])
def test_writes_are_split_to_max_batch_and_notify_rides_the_last(
    count: int, max_batch: int
) -> None:
    with mock_pair(max_batch=max_batch, notifications=True) as pair:
        descs, want = pair.descs(count, 4096)
        pair.a.write(pair.peer, descs, notify=b"req-1 done").wait(WAIT_S)

        posts = posted(pair.a)
        assert [c.op for c in posts] == ["post"] * math.ceil(count / (max_batch or count))
        assert all(c.descs is not None and 0 < len(c.descs) <= (max_batch or count) for c in posts)
        # The batches are the write's descriptors, in order, nothing lost or repeated.
        for field in ("src", "dst", "nbytes"):
            np.testing.assert_array_equal(
                np.concatenate([getattr(c.descs, field) for c in posts]), getattr(descs, field)
            )
        # Only the last batch carries the notification.
        assert [c.message for c in posts] == [None] * (len(posts) - 1) + [b"req-1 done"]
        np.testing.assert_array_equal(pair.dst, want)
        assert [n.message for n in drain(pair.b, 1)] == [b"req-1 done"]
        # The core releases every batch once it is done, and only once.
        assert [h.released for h in pair.driver.handles] == [1] * len(posts)


@pytest.mark.parametrize("stalled", [1, 2])
def test_the_notified_batch_waits_for_every_other_batch(stalled: int) -> None:
    """While any earlier batch is pending, however often polled, the last is not posted."""

    def handler(call: Call) -> str | None:
        return STALL if call.op == "post" and call.count == stalled else None

    with mock_pair(handler, max_batch=2, notifications=True) as pair:
        descs, _ = pair.descs(5, 64)
        t = pair.a.write(pair.peer, descs, notify=b"ready")
        assert [len(c.descs or ()) for c in posted(pair.a)] == [2, 2]  # the first two, at once
        for _ in range(100):
            assert t.poll() is Status.PENDING
        assert len(posted(pair.a)) == 2  # the notified batch never went out
        assert pair.b.notifications() == []
        assert [h.released for h in pair.driver.handles] == [0, 0]  # none ended yet
        t.abort()
        assert t.poll() is Status.FAILED
        assert len(posted(pair.a)) == 2
        assert [h.released for h in pair.driver.handles] == [1, 1]  # the stalled one too
        assert pair.b.notifications() == []  # nor will it


def test_a_notification_alone_uses_the_notify_primitive() -> None:
    with mock_pair(notifications=True) as pair:
        pair.a.write(pair.peer, Descriptors.empty(), notify=b"alone").wait(WAIT_S)
        assert [(c.op, c.descs, c.message) for c in posted(pair.a)] == [("notify", None, b"alone")]
        assert [n.message for n in drain(pair.b, 1)] == [b"alone"]


def test_an_empty_write_posts_nothing_and_is_done() -> None:
    with mock_pair() as pair:
        t = pair.a.write(pair.peer, Descriptors.empty())
        assert t.poll() is Status.DONE and t.error is None
        assert t.count == 0 and t.nbytes == 0
        assert posted(pair.a) == []


@pytest.mark.parametrize("k", [1, 2, 5])
def test_first_failed_post_is_the_error(k: int) -> None:
    def handler(call: Call) -> str | None:
        return f"link down at post #{call.count}" if call.op == "post" and call.count == k else None

    with mock_pair(handler, max_batch=2, notifications=True) as pair:
        descs, _ = pair.descs(10, 256)  # five batches
        t = pair.a.write(pair.peer, descs, notify=b"n")
        with pytest.raises(TransferError) as info:
            t.wait(WAIT_S)
        err = info.value
        assert t.error is err and t.poll() is Status.FAILED
        assert err.subject == pair.peer.name
        assert pair.peer.name in str(err)
        assert f"link down at post #{k}" in err.args[0]
        assert err.followups == []
        with pytest.raises(TransferError) as again:  # waiting again reports the same error
            t.wait(WAIT_S)
        assert again.value is err
        assert pair.b.notifications() == []  # a failed write never notifies
        # The notified batch goes out only after the others are done: never when one failed.
        assert len(posted(pair.a)) == (5 if k == 5 else 4)
        assert all(h.released == 1 for h in pair.driver.handles)


def test_later_failures_are_attached_not_substituted() -> None:
    """Posts #2 and #3 both fail; #2 (the first) is the error, #3 is attached to it."""

    def handler(call: Call) -> str | None:
        return (
            f"failure of post #{call.count}" if call.op == "post" and call.count in (2, 3) else None
        )

    with mock_pair(handler, max_batch=2, notifications=True) as pair:
        t = pair.a.write(pair.peer, pair.descs(10, 256)[0], notify=b"after")
        assert t.poll() is Status.FAILED
        err = t.error
        assert isinstance(err, TransferError)
        assert "failure of post #2" in err.args[0] and "#3" not in err.args[0]
        assert [f.args[0] for f in err.followups] == ["failure of post #3"]
        text = str(err)
        assert text.index("post #2") < text.index("post #3")
        assert len(posted(pair.a)) == 4  # the notified last batch was never posted


def test_a_refused_post_after_a_failed_batch_is_attached_to_that_failure() -> None:
    """The earlier batch's failure is the root cause; the refusal it provoked comes second."""

    def handler(call: Call) -> str | None:
        if call.op == "post" and call.count == 1:
            return "connection reset by peer (root cause)"
        if call.op == "post" and call.count == 2:
            raise RuntimeError("endpoint is in error state")
        return None

    with mock_pair(handler, max_batch=2) as pair:
        t = pair.a.write(pair.peer, pair.descs(5, 8)[0])
        with pytest.raises(TransferError) as info:
            t.wait(WAIT_S)
        err = info.value
        assert "root cause" in err.args[0] and "error state" not in err.args[0]
        assert [str(e) for e in err.followups] == [
            "posting 2 descriptors failed: endpoint is in error state"
        ]
        assert len(posted(pair.a)) == 2  # nothing more after the refusal


def test_a_refused_first_post_is_the_error_with_the_drivers_exception() -> None:
    refusal = RuntimeError("queue full")

    def handler(call: Call) -> None:
        if call.op == "post":
            raise refusal

    with mock_pair(handler, max_batch=2, notifications=True) as pair:
        before = pair.dst.copy()
        t = pair.a.write(pair.peer, pair.descs(5, 8)[0], notify=b"n")
        assert t.poll() is Status.FAILED
        assert t.error is not None and t.error.__cause__ is refusal
        assert "posting 2 descriptors failed: queue full" in str(t.error)
        assert len(posted(pair.a)) == 1
        np.testing.assert_array_equal(pair.dst, before)


def test_a_stalled_post_polls_without_blocking_and_a_timeout_is_not_a_failure() -> None:
    def handler(call: Call) -> str | None:
        return STALL if call.op == "post" else None

    with mock_pair(handler) as pair:
        t = pair.a.write(pair.peer, pair.descs(4, 512)[0])
        start = time.monotonic()
        states = {t.poll() for _ in range(1000)}
        assert time.monotonic() - start < 5  # a poll that blocked would never come back
        assert states == {Status.PENDING}
        with pytest.raises(TransferError, match="still pending") as info:
            t.wait(0.05)
        assert pair.peer.name in str(info.value)
        assert t.error is None and t.poll() is Status.PENDING  # a timeout is not a failure
