"""What crosses a process boundary: any bytes give a valid object or a clear XferError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.testing import manifest_regions

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
_BYTES = st.binary(max_size=200) | _VALUES.map(msgspec.msgpack.encode)


@settings(max_examples=200, deadline=None)
@given(data=_BYTES)
def test_manifest_decode_never_fails_unclearly(data: bytes) -> None:
    try:
        m = xk.Manifest.decode(data)
    except xk.ManifestError:
        return
    assert xk.Manifest.decode(m.encode()) == m  # whatever decodes is a valid manifest


@settings(max_examples=50, deadline=None)
@given(drawn=manifest_regions())
def test_corrupted_manifest_bytes_decode_or_fail_clearly(drawn) -> None:
    m = xk.Manifest.build(drawn.regions, tp_rank=drawn.tp_rank, tp_size=drawn.tp_size)
    data = bytearray(m.encode())
    assert xk.Manifest.decode(bytes(data)) == m
    for i in range(0, len(data), max(1, len(data) // 7)):
        data[i] ^= 0x5A
        with contextlib.suppress(xk.ManifestError):  # anything else fails the test
            xk.Manifest.decode(bytes(data))


@pytest.fixture(scope="module")
def backend():
    with xk.open_backend("loopback") as b:
        yield b


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_BYTES)
def test_connect_refuses_any_bad_endpoint_clearly(backend, data: bytes) -> None:
    with pytest.raises(xk.XferError):
        backend.connect(data, xk.Manifest.build([]))
