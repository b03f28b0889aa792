"""Notifications: named after their sender, waited for on request, refused when undeclared."""

from __future__ import annotations

import threading
import time

import pytest
from mock_pairs import WAIT_S, drain, mock_pair, posted

from xferkit import ArgumentError, CapabilityError, TransferError, XferError
from xferkit.testing.mock import Call


def test_a_notification_names_its_sender_as_the_senders_peers_are_named() -> None:
    with mock_pair(notifications=True) as pair:
        pair.a.write(pair.peer, pair.descs(2, 64)[0], notify=b"req-3").wait(WAIT_S)
        (note,) = drain(pair.b, 1)
        assert note.message == b"req-3"
        assert note.peer == f"mock:{pair.a.driver.address}"
        # The receiver's own peer for the sender has that name too: it can answer the sender.
        assert pair.a.manifest is not None
        back = pair.b.connect(pair.a.endpoint(), pair.a.manifest)
        assert back.name == note.peer


def test_notifications_wait_for_the_timeout_then_return() -> None:
    with mock_pair(notifications=True) as pair:
        start = time.monotonic()
        assert pair.b.notifications(timeout=0.2) == []
        assert 0.2 <= time.monotonic() - start < 2  # it waited, and not much longer
        start = time.monotonic()
        assert pair.b.notifications() == []  # no timeout: no wait
        assert pair.b.notifications(timeout=0) == []
        assert time.monotonic() - start < 0.1


def test_notifications_return_as_soon_as_one_arrives() -> None:
    with mock_pair(notifications=True) as pair:
        send = threading.Timer(
            0.2, lambda: pair.a.write(pair.peer, pair.descs(1, 8)[0], notify=b"late")
        )
        start = time.monotonic()
        send.start()
        try:
            notes = pair.b.notifications(timeout=WAIT_S)
        finally:
            send.join()
        took = time.monotonic() - start
        assert [n.message for n in notes] == [b"late"]
        assert 0.15 <= took < WAIT_S / 2  # woke on arrival, not at the deadline


@pytest.mark.parametrize("timeout", [-1, "1", float("nan"), True])
def test_a_bad_timeout_is_an_xfer_error(timeout: object) -> None:
    with mock_pair(notifications=True) as pair, pytest.raises(XferError, match="timeout"):
        pair.b.notifications(timeout=timeout)  # type: ignore[arg-type]


def test_notify_without_the_capability_is_refused_before_posting() -> None:
    with mock_pair(notifications=False) as pair:
        before = pair.dst.copy()
        with pytest.raises(CapabilityError, match="notifications"):
            pair.a.write(pair.peer, pair.descs(2, 64)[0], notify=b"done")
        assert posted(pair.a) == []
        assert (pair.dst == before).all()
        with pytest.raises(CapabilityError):
            pair.b.notifications()
        pair.a.write(pair.peer, pair.descs(2, 64)[0]).wait(WAIT_S)  # without notify it works
        assert len(posted(pair.a)) == 1


def test_a_notification_is_bytes() -> None:
    with mock_pair(notifications=True) as pair:
        with pytest.raises(ArgumentError, match="bytes, not str"):
            pair.a.write(pair.peer, pair.descs(1, 8)[0], notify="done")  # type: ignore[arg-type]
        assert posted(pair.a) == []


def test_a_driver_failing_to_receive_is_an_xfer_error() -> None:
    broken = OSError(9, "Bad file descriptor")

    def handler(call: Call) -> None:
        if call.op == "notifications":
            raise broken

    with mock_pair(handler, notifications=True) as pair:
        with pytest.raises(TransferError, match="receiving notifications failed") as info:
            pair.a.notifications()
        assert info.value.__cause__ is broken


def test_the_loopback_offers_a_descriptor_that_turns_readable_on_arrival() -> None:
    import select

    import numpy as np

    import xferkit as xk

    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    with xk.open_backend("loopback") as a, xk.open_backend("loopback") as b:
        a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="s", layer=0)]))
        b.register(xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="d", layer=0)]))
        fd = b.notification_fd()
        assert fd is not None
        assert not select.select([fd], [], [], 0)[0]  # nothing yet
        peer = a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        a.write(peer, xk.Descriptors.empty(), notify=b"hi").wait(10)
        assert select.select([fd], [], [], 10)[0]  # woken, no polling
        assert [n.message for n in b.notifications()] == [b"hi"]
        assert not select.select([fd], [], [], 0)[0]  # drained: quiet again
    with pytest.raises(xk.XferError, match="closed"):
        b.notification_fd()
