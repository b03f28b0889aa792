"""Capabilities are validated when declared: a driver cannot promise nonsense."""

from __future__ import annotations

from typing import Any

import pytest

from xferkit import ArgumentError, Backend, CapabilityError, OptionError
from xferkit.driver import Capabilities
from xferkit.testing.mock import MockDriver


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"max_batch": -1}, "max_batch"),
        ({"max_batch": 2.5}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"memory": frozenset()}, "memory"),
        ({"memory": frozenset({"cpu", "tpu"})}, "memory"),
        ({"notifications": 1}, "notifications"),
        ({"cross_process": "yes"}, "cross_process"),
        ({"descriptor_bytes": -1}, "descriptor_bytes"),
        ({"descriptor_bytes": 1e4}, "descriptor_bytes"),
        ({"copy_cost": 0.0}, "copy_cost"),
        ({"copy_cost": "2"}, "copy_cost"),
        ({"ends_are_final": 0}, "ends_are_final"),
        ({"ends_are_final": False}, "needs notifications"),  # how a receiver learns the end
    ],
)
def test_invalid_capabilities_are_option_errors(fields: dict[str, Any], text: str) -> None:
    with pytest.raises(OptionError, match=text):
        Capabilities(**fields)


def test_a_driver_option_out_of_range_is_an_option_error() -> None:
    with pytest.raises(OptionError, match="max_batch"):
        MockDriver(max_batch=-1)


def test_valid_capabilities_are_kept_as_declared() -> None:
    caps = Capabilities(memory=frozenset({"cpu", "cuda"}), notifications=True, max_batch=4)
    assert (caps.memory, caps.notifications, caps.cross_process, caps.max_batch) == (
        frozenset({"cpu", "cuda"}),
        True,
        False,
        4,
    )
    with Backend(MockDriver(max_batch=4)) as b:
        assert b.capabilities.max_batch == 4


def test_a_backend_needs_a_driver_with_capabilities() -> None:
    with pytest.raises(ArgumentError, match=r"Backend\(\) takes a Driver"):
        Backend(object())  # type: ignore[arg-type]
    driver = MockDriver()
    driver.capabilities = {"max_batch": 4}  # type: ignore[assignment]
    with pytest.raises(CapabilityError, match="declares no Capabilities"):
        Backend(driver)
