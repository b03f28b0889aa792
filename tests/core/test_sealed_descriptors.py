"""Descriptors a plan made for exactly these manifests skip the bounds scan; nothing else does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mock_pairs import WAIT_S, posted

import xferkit as xk
from xferkit import Backend, BoundsError, Descriptors, Manifest
from xferkit.driver import AddressTable
from xferkit.testing import Reference, RegionSpec
from xferkit.testing.mock import MockDriver

REQUEST = {"kv": ([1, 2, 3], [5, 6, 7])}


@pytest.fixture
def planned() -> Iterator[tuple[Reference, Backend, Backend]]:
    """Two mock backends holding a 1 -> 1 KV layout."""
    spec = RegionSpec(pool="kv", name="k", layer=0, shape=(4, 8), tp_axis=0)
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 8}, dst_slots={"kv": 8})
    with Backend(MockDriver()) as a, Backend(MockDriver()) as b:
        a.register(ref.srcs[0].manifest)
        b.register(ref.dsts[0].manifest)
        yield ref, a, b


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every bounds scan: each goes through an ``AddressTable`` lookup."""
    seen: list[str] = []
    for name in ("locate", "first_outside"):
        real = getattr(AddressTable, name)

        def lookup(self: AddressTable, *args: Any, _real: Any = real, _name: str = name) -> Any:
            seen.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(AddressTable, name, lookup)
    return seen


def test_planned_descriptors_skip_the_scan_only_when_provably_in_bounds(
    planned: tuple[Reference, Backend, Backend], scans: list[str]
) -> None:
    ref, a, b = planned
    src_manifest, dst_manifest = ref.srcs[0].manifest, ref.dsts[0].manifest
    copies = xk.plan(src_manifest, dst_manifest).expand(REQUEST)
    assert copies.origin == (src_manifest, dst_manifest)
    with pytest.raises(ValueError):
        copies.src[0] = 0  # read-only: what the plan proved stays true
    with pytest.raises(ValueError):
        copies.dst.setflags(write=True)  # and cannot simply be unlocked
    peer = a.connect(b.endpoint(), dst_manifest)
    scans.clear()
    a.write(peer, copies).wait(WAIT_S)
    assert scans == []  # proven by construction: no scan
    ref.check(0, REQUEST)
    # The peer advertised an equal manifest, but not the one planned for: both sides scanned.
    twin = Manifest.decode(dst_manifest.encode())
    a.write(a.connect(b.endpoint(), twin), copies).wait(WAIT_S)
    assert len(scans) == 2
    # A copy of the same descriptors, unsealed: scanned too.
    scans.clear()
    a.write(peer, Descriptors(copies.src.copy(), copies.dst.copy(), copies.nbytes.copy()))
    assert len(scans) == 2


def test_forged_or_unlocked_descriptors_lose_the_seal_and_are_refused(
    planned: tuple[Reference, Backend, Backend],
) -> None:
    ref, a, b = planned
    src_manifest, dst_manifest = ref.srcs[0].manifest, ref.dsts[0].manifest
    copies = xk.plan(src_manifest, dst_manifest).expand({"kv": ([1], [5])})
    peer = a.connect(b.endpoint(), dst_manifest)
    far = copies.dst + np.uint64(1 << 40)
    far.setflags(write=False)
    forged = [
        Descriptors(copies.src, far, copies.nbytes),  # new arrays, even read-only ones
        Descriptors(copies.src, copies.dst, copies.nbytes),  # rewrapped: no seal either
    ]
    tampered = xk.plan(src_manifest, dst_manifest).expand({"kv": ([1], [5])})
    tampered.dst = far  # an array swapped in
    for d in (*forged, tampered):
        assert d.origin is None
    for d in (forged[0], tampered):
        with pytest.raises(BoundsError, match="destination"):
            a.write(peer, d)
    assert posted(a) == []  # the out-of-bounds ones never reached the driver
