"""The kit closes every backend it opened, even when one's close() raises (issue 23).

Before, the kit's ``finally: a.close(); b.close()`` (and its loops over ranks)
stopped at the first ``close()`` that raised: every backend after it stayed
open, its memory registered, for the rest of the author's test session.
"""

from __future__ import annotations

from typing import Any

import pytest

from xferkit import Backend, XferError
from xferkit.testing.conformance import BackendConformance
from xferkit.testing.mock import Call, MockDriver


def _refuse_close(call: Call) -> str | None:
    if call.op == "close":
        raise RuntimeError("engine refused to close")
    return None


class _KitOnMock(BackendConformance):
    """The kit against MockDriver, whose every other backend's close() raises (not collected)."""

    backend = "mock"

    def __init__(self) -> None:
        self.drivers: list[MockDriver] = []

    def open(self, **extra: Any) -> Backend:
        refuse = len(self.drivers) % 2 == 0  # every pair's sender: the same in every example
        driver = MockDriver(_refuse_close if refuse else None, **extra)
        self.drivers.append(driver)
        return Backend(driver)


@pytest.mark.parametrize(
    "test", ["test_random_descriptors_are_byte_exact", "test_heterogeneous_plan_through_backend"]
)
def test_every_backend_the_kit_opened_is_closed_when_one_close_raises(test: str) -> None:
    kit = _KitOnMock()
    with pytest.raises(XferError, match="engine refused to close"):
        getattr(kit, test)()
    assert len(kit.drivers) >= 2
    unclosed = [d.address for d in kit.drivers if not d.of("close")]
    assert unclosed == [], f"left open by the kit: {unclosed}"
