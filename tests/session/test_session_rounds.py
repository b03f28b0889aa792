"""Rounds through double-buffered staging, under random completion orders, against the reference.

The source packs and posts rounds as its halves free up; each wire copy lands
only when the schedule says so (as a driver's would, later), then the
destination unpacks it and credits the half back. A round packed into a half
still being read, or unpacked from a half already overwritten, corrupts
bytes the reference check sees.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xferkit import coverage
from xferkit.copier import CPU
from xferkit.descriptors import Descriptors
from xferkit.session.rounds import Halves, Inbound, Outbound, Slices
from xferkit.staging import PATHS, stage
from xferkit.testing import Reference, RegionSpec, execute

PAGES = 10


def _ref(src_tp: int, dst_tp: int) -> Reference:
    specs = [
        RegionSpec(pool="kv", name=n, layer=layer, shape=(8, 4, 16), itemsize=2, tp_axis=1)
        for layer in range(2)
        for n in "kv"
    ]
    slots = {"kv": PAGES}
    return Reference(specs, src_tp=src_tp, dst_tp=dst_tp, src_slots=slots, dst_slots=slots)


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([(2, 4), (4, 2), (3, 2), (1, 4)]),
    force=st.sampled_from(["staged", *PATHS]),
    halves=st.integers(1, 5),
    order=st.lists(st.integers(0, 6), max_size=300),
    seed=st.integers(0, 2**16),
    worker=st.booleans(),
)
def test_rounds_of_two_chunks_land_exactly_whatever_the_completion_order(
    tp: tuple[int, int], force: str, halves: int, order: list[int], seed: int, worker: bool
) -> None:
    """Two chunks of one request share the destination's slice, each its own source slice;
    with ``worker``, packs run on a thread, the next round's while this one is in flight."""
    with ThreadPoolExecutor(1) as pool:
        _two_chunks(tp, force, halves, order, seed, pool if worker else None)


def _two_chunks(
    tp: tuple[int, int],
    force: str,
    halves: int,
    order: list[int],
    seed: int,
    pool: ThreadPoolExecutor | None,
) -> None:
    def run(d: Descriptors) -> Future[None]:
        assert pool is not None
        return pool.submit(CPU.copy, d.src, d.dst, d.nbytes)

    ref = _ref(*tp)
    rng = np.random.default_rng(seed)
    src_slots, dst_slots = rng.permutation(PAGES)[:7], rng.permutation(PAGES)[:7]
    chunks = [
        {"kv": (src_slots[:3], dst_slots[:3])},
        {"kv": (src_slots[3:], dst_slots[3:])},
    ]
    srcs = [r.manifest for r in ref.srcs]
    unit = 8 * 4 * 16 * 2  # a whole global slot: no unit is larger
    half = unit * halves
    for di, rank in enumerate(ref.dsts):
        for p in coverage(srcs, rank.manifest).plans.values():
            staged = stage(p, descriptor_bytes=4096, force=force)  # type: ignore[arg-type]
            dst_buf = np.full(2 * half, 0xDD, dtype=np.uint8)
            shared = Halves()
            outs, ins, keep = [], [], []
            for chunk in chunks:
                req = staged.expand(chunk, src_capacity=half, dst_capacity=half)
                src_buf = np.full(2 * half, 0xEE, dtype=np.uint8)
                keep.append(src_buf)
                d = dst_buf.ctypes.data
                runner = run if pool is not None else None
                outs.append(Outbound(req, src_buf.ctypes.data, d, half, half, shared, CPU, runner))
                ins.append(Inbound(req, d, half, CPU))
                execute(req.direct)
            flight: list[tuple[int, int, int, Descriptors]] = []  # posted
            landed: list[tuple[int, int, int]] = []  # its bytes in staging, not unpacked yet
            steps = iter(order)
            while flight or landed or not all(o.finished for o in outs):
                step = next(steps, 0)
                if step < 3 or not (flight or landed):
                    posted = None
                    for j in (step % 2, 1 - step % 2):
                        if (posted := outs[j].ready()) is not None:
                            flight.append((j, *posted))
                            break
                    if posted is not None:
                        continue
                    packing = [o.packing[3] for o in outs if o.packing and o.packing[3]]
                    if not (flight or landed) and packing:
                        for f in packing:
                            f.result()  # a round still packing on the worker
                        continue
                    assert flight or landed, "blocked with nothing in flight"
                if flight and (step < 5 or not landed):  # a write lands (drivers reorder)
                    j, k, h, wire = flight.pop(0 if step % 2 == 0 else -1)
                    execute(wire)
                    outs[j].written(k)
                    landed.append((j, k, h))
                else:  # the destination sees a completion: it unpacks, then credits the half
                    j, k, h = landed.pop(0)
                    assert ins[j].landed(k, h)
                    assert not ins[j].landed(k, h)  # a duplicate completion copies nothing
                    outs[j].unpacked(k)
            assert all(i.finished for i in ins)
        ref.check(di, {"kv": (src_slots, dst_slots)})


def test_slices_hand_out_each_slice_once_and_take_it_back() -> None:
    s = Slices(1000, 350, 100)
    got = [s.take() for _ in range(4)]
    assert got == [1000, 1100, 1200, None]
    s.give(1100)
    s.give(1100)  # twice: once
    assert s.take() == 1100 and s.take() is None
    assert s.half == 50
    assert Slices(0, 100, 0).take() is None
