"""The loopback driver passes the conformance kit, with and without batch splitting."""

from __future__ import annotations

from typing import Any, ClassVar

from xferkit.testing.conformance import BackendConformance


class TestLoopback(BackendConformance):
    backend = "loopback"


class TestLoopbackSmallBatches(TestLoopback):
    """Every write is split into 3-descriptor batches: the core's splitting must be invisible."""

    options: ClassVar[dict[str, Any]] = {"max_batch": 3}
