"""Manifests cross a process boundary: any bytes give a valid manifest or a ManifestError."""

from __future__ import annotations

import contextlib

from hypothesis import given, settings

import xferkit as xk
from xferkit.testing import manifest_regions, wire_bytes


@settings(max_examples=200, deadline=None)
@given(data=wire_bytes())
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
