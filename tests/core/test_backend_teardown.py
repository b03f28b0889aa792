"""Teardown: close ends transfers, then disconnects, deregisters and closes, each step always."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from mock_pairs import WAIT_S, buffer, manifest, mock, mock_pair

from xferkit import Backend, RegistrationError, Status, TransferError, XferError
from xferkit.testing.mock import STALL, Call, MockDriver


def test_close_disconnects_deregisters_and_closes_once_in_that_order() -> None:
    with mock_pair() as pair:
        a, driver = pair.a, pair.driver
        m = a.manifest
        assert m is not None
        a.close()
        a.close()  # idempotent
        tail = [(c.op, c.region or c.link) for c in driver.calls[-3:]]
        assert tail == [
            ("disconnect", pair.b.driver.address),
            ("deregister", m.regions[0]),
            ("close", None),
        ]
        assert len(driver.of("close")) == 1
        assert driver.registered == set() and a.manifest is None


def test_every_public_method_refuses_use_after_close() -> None:
    with mock_pair(notifications=True) as pair:
        a, b, m = pair.a, pair.b, pair.b.manifest
        assert m is not None
        endpoint = b.endpoint()
        copies, _ = pair.descs(1, 8)
        a.close()
        calls = list(pair.driver.calls)
        uses: dict[str, Callable[[], Any]] = {
            "register": lambda: a.register(manifest([buffer(64, 3)], "again")),
            "endpoint": a.endpoint,
            "connect": lambda: a.connect(endpoint, m),
            "write": lambda: a.write(pair.peer, copies),
            "notifications": a.notifications,
            "deregister": a.deregister,
            "disconnect": lambda: a.disconnect(pair.peer),
            "fence": lambda: a.fence("mock:b"),
        }
        for name, use in uses.items():
            with pytest.raises(XferError, match=f"{name}\\(\\): this mock backend is closed"):
                use()
        with pytest.raises(XferError, match="closed"):
            a.notifications(timeout=1.0)
        a.close()  # close alone stays idempotent
        assert pair.driver.calls == calls  # the driver saw none of it


def test_the_context_manager_closes_even_on_error() -> None:
    driver = MockDriver()
    with pytest.raises(KeyError), Backend(driver) as b:
        b.register(manifest([buffer(128, 23)], "c"))
        raise KeyError("boom")
    assert len(driver.of("close")) == 1 and driver.registered == set()
    with pytest.raises(XferError, match="closed"):
        b.endpoint()


def test_close_runs_every_step_and_reports_the_first_failure() -> None:
    def handler(call: Call) -> None:
        if call.op in ("disconnect", "deregister", "close"):
            raise RuntimeError(f"{call.op} failed")

    with mock_pair(handler) as pair:
        a, driver = pair.a, pair.driver
        with pytest.raises(TransferError, match="disconnect failed") as info:
            a.close()
        err = info.value
        assert isinstance(err.__cause__, RuntimeError)
        # Deregistration and the driver's close still ran, although disconnecting failed first.
        assert [c.op for c in driver.calls[-3:]] == ["disconnect", "deregister", "close"]
        assert [type(e) for e in err.followups] == [RegistrationError, TransferError]
        assert "deregister failed" in str(err.followups[0])
        assert "close failed" in str(err.followups[1])
        calls = len(driver.calls)
        a.close()  # idempotent, even after a failed close
        assert len(driver.calls) == calls


def test_close_attaches_later_failures_to_a_first_xfer_error() -> None:
    def handler(call: Call) -> None:
        if call.op == "deregister":
            raise RuntimeError("deregister failed")
        if call.op == "close":
            raise RuntimeError("close failed (secondary)")

    a = Backend(MockDriver(handler))
    a.register(manifest([buffer(64, 1)], "src"))
    with pytest.raises(RegistrationError, match="deregister failed") as info:
        a.close()
    assert [str(e) for e in info.value.followups] == [
        "mock: closing failed: RuntimeError: close failed (secondary)"
    ]


def test_close_aborts_transfers_in_flight_before_disconnecting_or_deregistering() -> None:
    transfers: list[Any] = []
    seen: list[tuple[str, Status]] = []

    def handler(call: Call) -> str | None:
        if call.op == "post":
            return STALL
        if call.op in ("disconnect", "deregister", "close"):
            seen.extend((call.op, t.poll()) for t in transfers)
        return None

    with mock_pair(handler, max_batch=1, notifications=True) as pair:
        t = pair.a.write(pair.peer, pair.descs(3, 64)[0], notify=b"never")
        transfers.append(t)
        assert t.poll() is Status.PENDING
        pair.a.close()
        assert seen == [
            ("disconnect", Status.FAILED),
            ("deregister", Status.FAILED),
            ("close", Status.FAILED),
        ]
        assert [c.op for c in mock(pair.a).calls] == [
            "register",
            "connect",
            "post",
            "post",
            "disconnect",
            "deregister",
            "close",
        ]
        assert t.error is not None and "closed" in str(t.error)
        assert [h.released for h in mock(pair.a).handles] == [1, 1]  # each released once
        with pytest.raises(TransferError, match="closed"):
            t.wait(WAIT_S)
        assert pair.b.notifications() == []
