"""What every part of the conformance kit shares: the knobs a driver's tests set, and helpers.

``BackendConformance`` (``xferkit.testing.conformance``) is the in-process
tests (``inprocess``) plus the cross-process ones (``crossprocess``), both
built on ``KitBase``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np
import pytest

from ..backend import Backend
from ..descriptors import Descriptors
from ..errors import XferError
from ..manifest import Manifest
from ..plugins import accepted_options, open_backend
from .memory import manifest_of, random_bytes
from .models import gdn_hybrid
from .reference import RegionSpec


def gdn_hybrid_specs() -> list[RegionSpec]:
    """The kit's model: a small GDN hybrid (see ``xferkit.testing.models.gdn_hybrid``)."""
    return gdn_hybrid(4)


SRC_SLOTS, DST_SLOTS = {"kv": 24, "state": 6}, {"kv": 32, "state": 6}
REQUEST = {"kv": ([3, 4, 5, 9, 20], [0, 1, 2, 30, 7]), "state": ([2], [5])}

BATCHES = ("writes", "split")
"""How the teardown tests put many batches in flight: several writes at once (each split
further by a declared ``max_batch``), or (only for a driver whose options include
``batch_option``) one write the core splits into many small batches."""


class KitBase:
    """Subclass with ``backend`` (a registered backend name) and ``options``."""

    backend: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    wait_s: ClassVar[float] = 30.0
    deadline_s: ClassVar[float] = 2.0
    """The deadline the frozen-peer test gives a write."""
    drain_s: ClassVar[float] = 10.0
    """How long after its deadline a write may take to end (the driver letting go of it)."""
    settle_s: ClassVar[float] = 2.0
    """How long the kit watches a resumed receiver's memory for bytes landing late."""
    batch_option: ClassVar[str | None] = "max_batch"
    """The option that sets your driver's batch limit, if it has one (None or not among your
    options: the teardown tests run with many writes only, never skipped)."""

    def open(self, **extra: Any) -> Backend:
        return open_backend(self.backend, **{**self.options, **extra})

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """``batches``: only the ways of batching this driver declares (nothing is skipped)."""
        if "batches" in metafunc.fixturenames:
            metafunc.parametrize("batches", self.batch_modes())

    def batch_modes(self) -> list[str]:
        try:
            declared = self.batch_option in accepted_options(self.backend)
        except XferError:  # not usable here: the tests say so when they open it
            declared = False
        return list(BATCHES) if declared else ["writes"]

    def batch_options(self, batches: str, per: int) -> dict[str, Any]:
        """The sender's extra options for ``batches``: its batch limit set to ``per`` to split."""
        if batches == "split":
            assert self.batch_option is not None
            return {self.batch_option: per}
        return {}


def in_batches(batches: str, descs: Descriptors, per: int) -> list[Descriptors]:
    """``descs`` as the writes ``batches`` asks for: one (the core splits it), or one per
    ``per`` descriptors."""
    if batches == "split":
        return [descs]
    return [
        Descriptors(descs.src[i : i + per], descs.dst[i : i + per], descs.nbytes[i : i + per])
        for i in range(0, len(descs), per)
    ]


def buffers(sizes: list[int], seed: int) -> list[np.ndarray]:
    return [random_bytes(n, seed * 1000 + i) for i, n in enumerate(sizes)]


def raw_manifest(arrays: list[np.ndarray], name: str) -> Manifest:
    return manifest_of(arrays, name, pool="raw")


def note(backend: Backend) -> bytes | None:
    return b"n" if backend.capabilities.notifications else None


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def held(backend: Backend) -> Manifest:
    """The manifest a backend registered (the kit registers before it asks)."""
    assert backend.manifest is not None
    return backend.manifest


ENDED = b"xferkit-kit: the writes before me ended"
"""The notification a driver whose ends are not final (``Capabilities.ends_are_final``) is
sent after its writes ended: once it lands, none of their bytes may land any more."""


def post_end(backend: Backend, peer: Any) -> None:
    """Post ``ENDED`` to ``peer``: a notification with no data, behind the writes before it."""
    backend.write(peer, Descriptors.empty(), notify=ENDED).wait(10.0)


def await_end(notes: Any, timeout: float) -> None:
    """Wait until ``ENDED`` landed (``notes(t)``: the notifications that landed, waiting up to
    ``t`` for one), failing the test if it does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(message == ENDED for message in notes(0.05)):
            return
    raise AssertionError(f"the notification behind the ended writes did not land in {timeout} s")


def drain_until(backend: Backend, count: int, timeout: float, while_polling: Any = None) -> list:
    """Notifications until ``count`` arrived or ``timeout``; polls a sender's transfer meanwhile."""
    notes: list = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        if while_polling is not None:
            while_polling.poll()  # a split write progresses while its sender polls
        notes += backend.notifications(timeout=0.01)
    return notes
