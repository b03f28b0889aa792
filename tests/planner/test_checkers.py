"""The shipped checkers catch what they promise to: each broken handoff or descriptor set fails.

``xferkit.testing.handoff`` and ``check_descriptors`` vouch for every planner
test and for drivers run through the kit, so a checker that passes broken
input would hide bugs everywhere: each case here breaks one promise on
purpose and expects the AssertionError.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from xferkit import Descriptors, coverage
from xferkit.testing import (
    Reference,
    RegionSpec,
    WriteCounter,
    check_descriptors,
    execute,
    handoff,
)

SPECS = [
    RegionSpec(pool="kv", name=n, layer=layer, shape=(4, 8), itemsize=2, tp_axis=0)
    for layer in range(2)
    for n in ("k", "v")
]
REQUEST = {"kv": (np.array([1, 2, 5]), np.array([0, 1, 7]))}


def _ref(src_tp: int = 2, dst_tp: int = 1) -> Reference:
    return Reference(SPECS, src_tp=src_tp, dst_tp=dst_tp, src_slots={"kv": 8}, dst_slots={"kv": 8})


def _descs(src: list[int], dst: list[int], nbytes: list[int]) -> Descriptors:
    return Descriptors(*(np.array(a, dtype=np.uint64) for a in (src, dst, nbytes)))


def test_handoff_passes_a_correct_handoff_and_counts_descriptors() -> None:
    counts = handoff(_ref(), REQUEST)
    # TP 2 -> 1: the decode rank gathers half the heads of each slot from each prefill
    # rank. Per region and source, one run per requested slot (a destination slot's other
    # heads come from the other source, so no two slots merge): 3 runs x 4 regions.
    assert counts == {0: {0: 12, 1: 12}}


def _skip_second(s: int, d: int, descs: Descriptors) -> None:
    if s == 0:
        execute(descs)


def _twice(s: int, d: int, descs: Descriptors) -> None:
    execute(descs)
    execute(descs)


def _half(s: int, d: int, descs: Descriptors) -> None:
    execute(Descriptors(descs.src, descs.dst, descs.nbytes // np.uint64(2)))


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (_skip_second, "differs from the reference"),  # a source's batch never lands
        (_half, "differs from the reference"),  # each copy moves half its bytes
    ],
)
def test_handoff_fails_a_writer_that_loses_bytes(
    write: Callable[[int, int, Descriptors], None], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        handoff(_ref(), REQUEST, write=write)


def test_handoff_fails_a_writer_that_touches_a_source() -> None:
    ref = _ref()

    def scribble(s: int, d: int, descs: Descriptors) -> None:
        execute(descs)
        next(iter(ref.srcs[s].arrays.values()))[0, 0, 0] ^= 0xFF

    with pytest.raises(AssertionError, match=r"source region .* changed"):
        handoff(ref, REQUEST, write=scribble)


def test_handoff_fails_a_writer_that_writes_outside_the_request() -> None:
    ref = _ref()

    def spill(s: int, d: int, descs: Descriptors) -> None:
        execute(descs)
        if s == 0:
            for array in ref.dsts[d].arrays.values():
                array[3] ^= 0xFF  # slot 3 was not requested

    with pytest.raises(AssertionError, match=r"differs from the reference first at index \(3,"):
        handoff(ref, REQUEST, write=spill)


def test_write_counter_counts_every_write_and_refuses_foreign_memory() -> None:
    ref = _ref(dst_tp=2)
    counter = WriteCounter(ref.dsts)
    assert counter.max == 0 and counter.counts.sum() == 0
    r0, r1 = ref.dsts[0].manifest.regions[0], ref.dsts[1].manifest.regions[-1]
    counter.record(_descs([0, 0], [r0.addr, r1.addr + r1.nbytes - 4], [16, 4]))
    assert counter.max == 1 and counter.counts.sum() == 20
    counter.record(_descs([0], [r0.addr + 8], [2]))  # two bytes written again
    assert counter.max == 2 and counter.counts.sum() == 22 and (counter.counts == 2).sum() == 2
    with pytest.raises(AssertionError, match=r"descriptor 1 writes .* outside every region"):
        counter.record(_descs([0, 0], [r0.addr, r1.addr + r1.nbytes - 4], [1, 5]))
    assert counter.counts.sum() == 22  # a refused batch records nothing


def _planned() -> tuple[Reference, Descriptors]:
    ref = _ref(src_tp=1)
    cov = coverage([r.manifest for r in ref.srcs], ref.dsts[0].manifest)
    return ref, cov.plans[0].expand(REQUEST)


def _broken(descs: Descriptors, how: str) -> Descriptors:
    src, dst, n = (a.copy() for a in (descs.src, descs.dst, descs.nbytes))
    if how == "zero length":
        n[0] = 0
    elif how == "outside":
        dst[0] = 1 << 63  # no region lies there
    elif how == "split":  # one descriptor cut in two: still correct, no longer minimal
        half = n[:1] // 2
        src = np.concatenate([src[:1], src[:1] + half, src[1:]])
        dst = np.concatenate([dst[:1], dst[:1] + half, dst[1:]])
        n = np.concatenate([half, n[:1] - half, n[1:]])
    elif how == "overlap":  # the first copy listed twice
        src, dst, n = (np.concatenate([a, a[:1]]) for a in (src, dst, n))
    return Descriptors(src, dst, n)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("zero length", "zero-length descriptor"),
        ("outside", r"destination descriptor 0 .* is not inside one region"),
        ("split", "could be merged"),
        ("overlap", "two descriptors overlap"),
    ],
)
def test_check_descriptors_fails_broken_descriptors(how: str, message: str) -> None:
    ref, descs = _planned()
    src, dst = ref.srcs[0].manifest, ref.dsts[0].manifest
    check_descriptors(descs, src, dst)  # the planner's own pass
    with pytest.raises(AssertionError, match=message):
        check_descriptors(_broken(descs, how), src, dst)


def test_check_descriptors_fails_a_copy_between_different_regions() -> None:
    ref, descs = _planned()
    src, dst = ref.srcs[0].manifest, ref.dsts[0].manifest
    k0, v0 = dst.region(("kv", "k", 0, 0)), dst.region(("kv", "v", 0, 0))
    at = int(np.flatnonzero((descs.dst >= k0.addr) & (descs.dst < k0.addr + k0.nbytes))[0])
    moved = descs.dst.copy()
    moved[at] = moved[at] - np.uint64(k0.addr) + np.uint64(v0.addr)  # k's bytes into v
    with pytest.raises(AssertionError, match=f"descriptor {at} pairs regions of different keys"):
        check_descriptors(Descriptors(descs.src, moved, descs.nbytes), src, dst)
