"""Shared set-up for the core's tests: backends on ``MockDriver``, buffers, forged endpoints.

Every fault is chosen by a ``MockDriver`` handler and every primitive the core
called is read back from the driver's ``calls``; nothing is monkeypatched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from xferkit import Backend, Descriptors, Notification
from xferkit.testing import pairs as testing_pairs
from xferkit.testing.conformance import drain_until
from xferkit.testing.memory import descriptors, manifest_of, random_bytes
from xferkit.testing.mock import Handler, MockDriver
from xferkit.testing.pairs import connected_pair

WAIT_S = 10.0


buffer = random_bytes
manifest = manifest_of
descs = descriptors


def mock(backend: Backend) -> MockDriver:
    """The MockDriver behind ``backend``."""
    driver = backend.driver
    assert isinstance(driver, MockDriver)
    return driver


def posted(backend: Backend) -> list[Any]:
    """Every post and notify the core made on ``backend``'s driver, in order."""
    return [c for c in mock(backend).calls if c.op in ("post", "notify")]


def drain(backend: Backend, count: int, timeout: float = WAIT_S) -> list[Notification]:
    return drain_until(backend, count, timeout)


def forged(endpoint: bytes, blob: dict[str, Any] | None = None, **envelope: Any) -> bytes:
    """``endpoint`` re-encoded with some envelope fields (and/or the driver blob) replaced."""
    fields = msgspec.msgpack.decode(endpoint)
    assert isinstance(fields, dict) and isinstance(fields["blob"], dict)
    fields.update(envelope)
    if blob is not None:
        fields["blob"] = blob
    return msgspec.msgpack.encode(fields)


class Pair(testing_pairs.Pair):
    """``a`` writes into ``b``'s ``dst`` from its own ``src`` through ``peer``."""

    @property
    def driver(self) -> MockDriver:
        return mock(self.a)

    def descs(self, count: int, size: int) -> tuple[Descriptors, np.ndarray]:
        """``count`` pieces of ``size`` bytes, written in reverse order; and the dst expected."""
        s0, d0 = self.src.ctypes.data, self.dst.ctypes.data
        src = [s0 + i * size for i in range(count)]
        dst = [d0 + (count - 1 - i) * size for i in range(count)]
        want = self.dst.copy()
        for i in range(count):
            j = count - 1 - i
            want[j * size : (j + 1) * size] = self.src[i * size : (i + 1) * size]
        return descs(src, dst, [size] * count), want


@contextlib.contextmanager
def mock_pair(
    handler: Handler | None = None,
    *,
    size: int = 1 << 16,
    sender: MockDriver | None = None,
    **options: Any,
) -> Iterator[Pair]:
    """Two connected mock backends; ``a`` (the writer) runs ``handler``, or is ``sender``;
    both take ``options``."""
    with connected_pair(
        lambda: Backend(sender or MockDriver(handler, **options)),
        [buffer(size, 1)],
        [buffer(size, 2)],
        receiver=lambda: Backend(MockDriver(**options)),
    ) as p:
        yield Pair(p.a, p.b, p.srcs, p.dsts, p.peer, p.endpoint)
