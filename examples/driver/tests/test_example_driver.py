"""The example third-party driver passes the conformance kit, installed like any plugin."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import xferkit as xk
from xferkit.testing.conformance import BackendConformance

# The kit skips what the driver does not declare (cross-process peers); in this
# repository's CI a skip fails unless it says why it is legitimate.
pytestmark = pytest.mark.allow_skip("the example driver is in-process only by design")


class TestExampleDriver(BackendConformance):
    backend = "example"


class TestExampleDriverSmallBatches(BackendConformance):
    backend = "example"
    options: ClassVar[dict[str, Any]] = {"max_batch": 2}


def test_listed_under_its_distribution() -> None:
    info = next(b for b in xk.backends(check=True) if b.name == "example")
    assert info.available, info.reason
    assert info.distribution == "xferkit-example"
