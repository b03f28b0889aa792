"""``Backend.fence``: the core's checks around a driver's ``fence`` (the kit's
``test_a_fenced_sender_lands_nothing_more`` checks what a real driver does with it)."""

from __future__ import annotations

import msgspec
import pytest

from xferkit import Backend
from xferkit.driver import Capabilities
from xferkit.errors import CapabilityError, ProtocolError, TransferError
from xferkit.testing.mock import MockDriver


class _Fencing(MockDriver):
    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.capabilities = msgspec.structs.replace(self.capabilities, fencing=True)
        self.fenced: list[str] = []
        self.error = error

    def fence(self, source: str) -> None:
        if self.error is not None:
            raise self.error
        self.fenced.append(source)


def test_the_driver_is_told_the_peers_address_without_the_backend_name() -> None:
    driver = _Fencing()
    with Backend(driver) as b:
        b.fence("mock:mock-7")
    assert driver.fenced == ["mock-7"]


def test_another_backends_peer_is_refused_before_the_driver_sees_it() -> None:
    driver = _Fencing()
    with Backend(driver) as b:
        for source in ("nixl:agent-1", "mock:", "mock-7"):
            with pytest.raises(ProtocolError, match="not a mock peer"):
                b.fence(source)
    assert driver.fenced == []


def test_a_drivers_failure_is_a_transfer_error_naming_the_source() -> None:
    cause = OSError("the NIC said no")
    with Backend(_Fencing(cause)) as b, pytest.raises(TransferError) as info:
        b.fence("mock:mock-7")
    assert "fencing mock:mock-7" in str(info.value) and "the NIC said no" in str(info.value)
    assert info.value.__cause__ is cause


def test_a_driver_that_cannot_fence_says_so() -> None:
    assert Capabilities().fencing is False
    with Backend(MockDriver()) as b, pytest.raises(CapabilityError, match="cannot fence"):
        b.fence("mock:mock-7")
