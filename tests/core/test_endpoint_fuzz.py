"""What a peer's endpoint may carry: whatever it is, ``connect`` gives a Peer or an XferError.

The envelope is the core's (it refuses anything malformed before a driver
sees it); the blob inside is each driver's own. Both are fuzzed for every
driver installed here: the envelope with random bytes, the blob by taking a
real endpoint, decoding its envelope as a plain map and replacing the blob
with random bytes, random msgpack values, random instances of the driver's
``Blob`` type (well typed, meaningless) or the real blob with some fields
swapped for those. A raw ``msgspec``, ``OverflowError`` or engine exception
escaping ``connect`` fails the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.testing import msgpack_values, wire_bytes
from xferkit.testing.pairs import Pair, connected_pair

# What each driver needs to start here (Mooncake over TCP needs no RDMA device).
DRIVERS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}


@pytest.fixture(scope="module", params=sorted(DRIVERS))
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """``a`` connects; ``b``'s endpoint is the one fuzzed."""
    name: str = request.param
    info = [b for b in xk.backends() if b.name == name]
    if not info or not info[0].available:
        pytest.skip(f"{name} is not usable here: {info[0].reason if info else 'not installed'}")
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    with connected_pair(lambda: xk.open_backend(name, **DRIVERS[name]), [src], [dst]) as p:
        yield p


def _plain(value: msgspec.Struct) -> object:
    """A Blob instance as the plain msgpack value it encodes to; None if msgpack cannot carry it."""
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(value))
    except OverflowError:  # an int beyond 64 bits
        return None


@st.composite
def _blobs(draw: st.DrawFn, blob_type: type[msgspec.Struct], real: object) -> object:
    """A replacement for a real blob: noise, a wrong shape, or well typed but meaningless."""
    typed = st.from_type(blob_type).map(_plain).filter(lambda v: v is not None)
    kind = draw(st.sampled_from(["bytes", "value", "typed", "mixed", "mixed", "mixed"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "value":
        return draw(msgpack_values())
    if kind == "typed" or not isinstance(real, dict | list):
        return draw(typed)

    # The real blob with some fields swapped (for a well-typed value or any value) or dropped.
    def fields(value: object) -> dict:
        if isinstance(value, dict):
            return dict(value)
        return dict(enumerate(value)) if isinstance(value, list) else {}

    out, other = fields(real), fields(draw(typed))
    if not out:
        return other
    changed = st.lists(st.sampled_from(list(out)), min_size=1, max_size=len(out), unique=True)
    for field in draw(changed):
        fate = draw(st.sampled_from(["typed", "typed", "value", "drop"]))
        if fate == "typed" and field in other:
            out[field] = other[field]
        elif fate == "value":
            out[field] = draw(msgpack_values(max_leaves=5))
        elif fate == "drop":
            del out[field]
    return out if isinstance(real, dict) else list(out.values())


def _connect_or_refuse(p: Pair, endpoint: bytes) -> None:
    """connect succeeds (and so does disconnect) or raises an XferError; nothing else."""
    try:
        peer = p.a.connect(endpoint, p.manifest)
    except xk.XferError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("connected")
    with contextlib.suppress(xk.XferError):  # anything else fails the test
        p.a.disconnect(peer)


@settings(max_examples=100, deadline=None)
@given(data=wire_bytes())
def test_connect_refuses_any_bad_endpoint_clearly(pair: Pair, data: bytes) -> None:
    with pytest.raises(xk.XferError):
        pair.a.connect(data, pair.manifest)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_driver_blob_gives_a_peer_or_an_xfer_error(pair: Pair, data: st.DataObject) -> None:
    envelope = msgspec.msgpack.decode(pair.endpoint)
    assert isinstance(envelope, dict) and "blob" in envelope
    envelope["blob"] = data.draw(_blobs(pair.b.driver.Blob, envelope["blob"]), label="blob")
    _connect_or_refuse(pair, msgspec.msgpack.encode(envelope))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_envelope_field_gives_a_peer_or_an_xfer_error(pair: Pair, data: st.DataObject) -> None:
    """The envelope's own fields (who, which process, which contract) swapped for any value."""
    envelope = msgspec.msgpack.decode(pair.endpoint)
    assert isinstance(envelope, dict)
    field = data.draw(st.sampled_from(sorted(k for k in envelope if k != "blob")), label="field")
    same_type = {str: st.text(max_size=16), int: st.integers(-(2**63), 2**64 - 1)}
    values = same_type.get(type(envelope[field]), st.nothing()) | msgpack_values(max_leaves=5)
    envelope[field] = data.draw(values, label="value")
    _connect_or_refuse(pair, msgspec.msgpack.encode(envelope))


def test_the_real_endpoint_still_works_after_the_fuzz(pair: Pair) -> None:
    """The refusals left nothing behind: the genuine endpoint connects and a write lands."""
    src, dst = pair.src, pair.dst
    dst[:] = 0
    peer = pair.a.connect(pair.endpoint, pair.manifest)
    descs = xk.Descriptors(
        np.array([src.ctypes.data], np.uint64),
        np.array([dst.ctypes.data], np.uint64),
        np.array([src.nbytes], np.uint64),
    )
    pair.a.write(peer, descs).wait(30)
    np.testing.assert_array_equal(dst, src)
    pair.a.disconnect(peer)
