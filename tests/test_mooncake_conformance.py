"""The Mooncake driver passes the conformance kit: the real engine over TCP on 127.0.0.1."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

from xferkit.testing.conformance import BackendConformance

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}


class TestMooncake(BackendConformance):
    backend = "mooncake"
    options: ClassVar[dict[str, Any]] = OPTIONS

    @contextlib.contextmanager
    def refusing_registration(self, backend, at):
        # Mooncake refuses for real: the at-th region is already registered with the
        # engine behind the core's back, so batch_register_memory returns -7.
        engine = backend._engine
        regions = []
        real = type(backend)._register_batch

        def spy(regions_):
            regions.extend(regions_)
            target = regions_[at - 1]
            assert engine.register_memory(target.addr, target.nbytes) == 0
            return real(backend, regions_)

        backend._register_batch = spy
        try:
            yield
        finally:
            del backend._register_batch
            if regions:
                assert engine.unregister_memory(regions[at - 1].addr) == 0


class TestMooncakeSmallBatches(TestMooncake):
    """Every write is split into 3-descriptor batches: the core's splitting must be invisible."""

    options: ClassVar[dict[str, Any]] = {**OPTIONS, "max_batch": 3}
