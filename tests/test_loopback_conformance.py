"""The loopback driver passes the conformance kit, with and without batch splitting."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from xferkit.testing.conformance import BackendConformance


class TestLoopback(BackendConformance):
    backend = "loopback"

    @contextlib.contextmanager
    def refusing_registration(self, backend, at):
        # The loopback can refuse for real, inside the driver.
        backend.faults.fail_register_at = at
        try:
            yield
        finally:
            backend.faults.fail_register_at = None


class TestLoopbackSmallBatches(TestLoopback):
    """Every write is split into 3-descriptor batches: the core's splitting must be invisible."""

    options: ClassVar[dict[str, Any]] = {"max_batch": 3}
