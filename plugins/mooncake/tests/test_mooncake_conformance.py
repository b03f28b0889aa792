"""The Mooncake driver passes the conformance kit: the real engine over TCP on 127.0.0.1."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

from xferkit.testing.conformance import BackendConformance

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}


class TestMooncake(BackendConformance):
    backend = "mooncake"
    options: ClassVar[dict[str, Any]] = OPTIONS


class TestMooncakeSmallBatches(TestMooncake):
    """Every write is split into 3-descriptor batches: the core's splitting must be invisible."""

    options: ClassVar[dict[str, Any]] = {**OPTIONS, "max_batch": 3}
