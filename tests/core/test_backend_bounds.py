"""Descriptors are checked in full before anything is posted: bounds, lengths, shapes."""

from __future__ import annotations

import numpy as np
import pytest
from mock_pairs import WAIT_S, buffer, descs, manifest, mock_pair, posted

from xferkit import ArgumentError, Backend, BoundsError, Descriptors
from xferkit.testing.mock import MockDriver


def test_bounds_and_zero_length_are_refused_before_posting() -> None:
    with mock_pair(size=4096) as pair:
        before = pair.dst.copy()
        s0, d0, size = pair.src.ctypes.data, pair.dst.ctypes.data, pair.src.size
        cases = [
            ([s0], [d0], [0], 0, "descriptor 0 is 0 bytes"),
            ([s0, s0], [d0, d0 + 8], [8, 0], 1, "descriptor 1 is 0 bytes"),
            ([s0], [d0], [size + 1], 0, "descriptor 0: source"),  # past the source region's end
            ([s0 + 8], [d0 + size - 4], [8], 0, "descriptor 0: destination"),  # past the peer's
            ([1 << 20], [d0], [8], 0, "descriptor 0: source"),  # unregistered source
            ([s0, s0], [d0, 1 << 20], [8, 8], 1, "descriptor 1: destination"),  # one bad of two
        ]
        for s, d, n, index, text in cases:
            with pytest.raises(BoundsError, match=text) as info:
                pair.a.write(pair.peer, descs(s, d, n))
            assert info.value.subject == index
        assert posted(pair.a) == []
        np.testing.assert_array_equal(pair.dst, before)  # untouched


def test_a_bounds_error_names_the_nearest_region() -> None:
    with mock_pair(size=4096) as pair:
        s0, d0 = pair.src.ctypes.data, pair.dst.ctypes.data
        assert pair.b.manifest is not None
        region = pair.b.manifest.regions[0]
        with pytest.raises(BoundsError) as info:
            pair.a.write(pair.peer, descs([s0], [d0 + 4090], [8]))
        text = str(info.value)
        assert f"advertised by peer {pair.peer.name}" in text
        assert f"nearest is {region.label} [{region.addr:#x}, +{region.nbytes})" in text


def test_malformed_descriptor_arrays_are_refused() -> None:
    """Made so, they are an ArgumentError at once (before: later, any call on them raised
    numpy's or Python's own error); an array replaced afterwards is the backend's
    BoundsError, and nothing is posted."""
    with mock_pair() as pair:
        good, _ = pair.descs(2, 64)
        bad = [
            (good.src.astype(np.int64), good.dst, good.nbytes),  # dtype
            (good.src, good.dst, good.nbytes.astype(np.uint32)),  # dtype
            (good.src.reshape(1, 2), good.dst.reshape(1, 2), good.nbytes.reshape(1, 2)),
            (good.src, good.dst[:1], good.nbytes),  # lengths differ
            (good.src.tolist(), good.dst.tolist(), good.nbytes.tolist()),
        ]
        for arrays in bad:
            with pytest.raises(ArgumentError, match=r"uint64|1 destinations"):
                Descriptors(*arrays)  # type: ignore[arg-type]
        for field in ("src", "nbytes"):
            swapped = Descriptors(good.src, good.dst, good.nbytes)
            setattr(swapped, field, getattr(good, field).astype(np.int64))
            with pytest.raises(BoundsError, match="uint64"):
                pair.a.write(pair.peer, swapped)
        with pytest.raises(ArgumentError, match="takes a Descriptors"):
            pair.a.write(pair.peer, (good.src, good.dst, good.nbytes))  # type: ignore[arg-type]
        assert posted(pair.a) == []


def test_a_descriptor_wrapping_around_2_64_is_refused() -> None:
    with mock_pair() as pair:
        s0, d0 = pair.src.ctypes.data, pair.dst.ctypes.data
        # src + nbytes wraps to s0 + 4: below the region's end, so only the wrap gives it away.
        with pytest.raises(BoundsError, match="descriptor 1: source") as info:
            pair.a.write(pair.peer, descs([s0, s0 + 8], [d0, d0 + 64], [64, 2**64 - 4]))
        assert info.value.subject == 1
        assert posted(pair.a) == []


def test_a_descriptor_spanning_two_adjacent_regions_is_refused() -> None:
    src, dst = buffer(8192, 7), buffer(8192, 8)
    with Backend(MockDriver()) as a, Backend(MockDriver()) as b:
        a.register(manifest([src[:4096], src[4096:]], "src"))  # adjacent, one allocation
        b.register(manifest([dst[:4096], dst[4096:]], "dst"))
        assert b.manifest is not None
        peer = a.connect(b.endpoint(), b.manifest)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        before = dst.copy()
        with pytest.raises(BoundsError, match="source"):
            a.write(peer, descs([s0 + 4000], [d0], [200]))
        with pytest.raises(BoundsError, match=f"destination .* advertised by peer {peer.name}"):
            a.write(peer, descs([s0], [d0 + 4000], [200]))
        assert posted(a) == []
        np.testing.assert_array_equal(dst, before)
        # The same bytes, split at the boundary, go through.
        a.write(peer, descs([s0 + 3900, s0 + 4096], [d0 + 3900, d0 + 4096], [196, 200])).wait(
            WAIT_S
        )
        np.testing.assert_array_equal(dst[3900:4296], src[3900:4296])


def test_write_before_register_is_a_bounds_error() -> None:
    with mock_pair() as pair, Backend(MockDriver()) as fresh:
        assert pair.b.manifest is not None
        peer = fresh.connect(pair.b.endpoint(), pair.b.manifest)  # connecting needs no memory
        with pytest.raises(BoundsError, match="register"):
            fresh.write(peer, pair.descs(1, 64)[0])
        assert posted(fresh) == []
