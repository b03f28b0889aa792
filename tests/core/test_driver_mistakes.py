"""A driver's mistakes: refused at once, naming the driver, never a hang or a raw exception.

Each driver here is a ``MockDriver`` subclass with one primitive gone wrong
(issue 20): a handle whose ``poll`` answers ``"done"``, a ``post`` returning
None, a ``poll`` raising, ``notifications=True`` without the methods, an
endpoint of the wrong type. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from mock_pairs import Pair, buffer, manifest, mock_pair

from xferkit import Backend, CapabilityError, PluginError, Status, TransferError
from xferkit.driver import Descriptors, Driver, Posted
from xferkit.testing.mock import MockDriver
from xferkit.transfer import Phase

WAIT_S = 3.0


class _Odd(Posted):
    """A handle whose ``poll`` answers ``answer`` (or raises it); counts its releases."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.released = 0

    def poll(self) -> Status:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]

    @property
    def error(self) -> str:
        return ""

    def release(self) -> None:
        self.released += 1


class _OddPoster(MockDriver):
    """Posts return ``self.answer``: a handle, or anything a broken driver returns."""

    answer: Any = None

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        self.handles.append(self.answer)
        return self.answer  # type: ignore[no-any-return]


@contextlib.contextmanager
def _pair(answer: Any) -> Iterator[Pair]:
    driver = _OddPoster(notifications=False)
    driver.answer = answer
    with mock_pair(sender=driver, size=4096, notifications=False) as pair:
        yield pair


@pytest.mark.parametrize("answer", ["done", True, 1, None, Status.DONE.value])
def test_a_poll_answering_no_status_fails_the_write_at_once_naming_driver_and_value(
    answer: Any,
) -> None:
    handle = _Odd(answer)
    with _pair(handle) as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        assert t.poll() is Status.FAILED and t.phase is Phase.FAILED
        with pytest.raises(TransferError) as exc:
            t.wait(WAIT_S)
        text = str(exc.value)
        assert "mock" in text and repr(answer) in text and "Status" in text
        assert exc.value.subject == pair.peer.name
        assert handle.released == 1
        assert t not in pair.a._inflight


def test_a_post_returning_none_fails_the_write_naming_the_driver() -> None:
    with _pair(None) as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        assert t.poll() is Status.FAILED
        with pytest.raises(TransferError, match=r"mock.*post\(\) returned None") as exc:
            t.wait(WAIT_S)
        assert pair.peer.name in str(exc.value)


def test_a_poll_raising_fails_the_write_with_the_peer_and_the_drivers_error() -> None:
    handle = _Odd(ValueError("engine state 7"))
    with _pair(handle) as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        assert t.poll() is Status.FAILED
        with pytest.raises(TransferError) as exc:
            t.wait(WAIT_S)
        text = str(exc.value)
        assert pair.peer.name in text and "ValueError" in text and "engine state 7" in text
        assert isinstance(exc.value.__cause__, ValueError)
        assert handle.released == 1


def test_a_handle_turning_bad_later_fails_the_write_too() -> None:
    """PENDING first, then a non-Status: the transfer turns FAILED on the next poll."""
    handle = _Odd(Status.PENDING)
    with _pair(handle) as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        assert t.poll() is Status.PENDING
        handle.answer = "done"
        assert t.poll() is Status.FAILED
        assert t.error is not None and "'done'" in str(t.error)


class _Deaf(MockDriver):
    """Declares notifications (MockDriver's default) but inherits Driver's ``notifications()``."""

    notifications = Driver.notifications  # type: ignore[assignment]


class _Mute(MockDriver):
    notify = Driver.notify  # type: ignore[assignment]


@pytest.mark.parametrize(("cls", "method"), [(_Deaf, "notifications()"), (_Mute, "notify()")])
def test_declaring_notifications_without_implementing_them_is_refused_at_open(
    cls: type[MockDriver], method: str
) -> None:
    driver = cls(notifications=True)
    with pytest.raises(CapabilityError) as exc:
        Backend(driver)
    assert "mock" in str(exc.value) and method in str(exc.value)
    driver.close()
    Backend(cls(notifications=False)).close()  # undeclared: nothing is missing


class _OtherBlob(msgspec.Struct):
    host: str


@pytest.mark.parametrize("value", [_OtherBlob("h"), {"address": "x"}, None])
def test_an_endpoint_of_the_wrong_type_is_reported_where_the_driver_runs(value: Any) -> None:
    driver = MockDriver(notifications=False)
    driver.endpoint = lambda: value  # type: ignore[method-assign]
    with Backend(driver) as a:
        a.register(manifest([buffer(64, 1)], "src"))
        with pytest.raises(PluginError) as exc:
            a.endpoint()
        text = str(exc.value)
        assert "mock" in text and "_Blob" in text and type(value).__name__ in text
