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
from xferkit.manifest import Manifest
from xferkit.session.rounds import (
    ALIGN,
    HOST_OFFSET,
    HOST_PAGE,
    Arena,
    Halves,
    Inbound,
    Outbound,
    Staging,
)
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


def test_host_staging_starts_on_a_cache_line_half_a_page_from_page_aligned_pools() -> None:
    """numpy's allocations start 16 bytes into a page: staging pieces sat 16 bytes into a
    cache line, and a pack of whole pages from a page-aligned pool wrote 16 bytes ahead of
    its source modulo 4 KiB, where this machine's memcpy runs at a third of its speed."""
    nbytes = (1 << 20) + 3 * ALIGN
    staging = Staging(Manifest((), 0, 1), nbytes)
    assert staging.addr % HOST_PAGE == HOST_OFFSET
    (region,) = staging.manifest.regions
    assert (region.addr, region.nbytes) == (staging.addr, nbytes)  # what it registers
    staging.buffer[:] = 7  # every byte it advertises is its own
    arena = staging.arena(1 << 18)
    pages = [arena.take(n * HOST_PAGE) for n in (1, 2, 3)]
    odd = [arena.take(n) for n in (1, ALIGN + 1)]
    assert all(p is not None and p % HOST_PAGE == HOST_OFFSET for p in pages)
    assert all(p is not None and p % ALIGN == 0 for p in odd)


def test_the_arena_hands_out_pieces_sized_to_their_chunks_and_merges_them_back() -> None:
    base = 1 << 20
    a = Arena(base, 8 * ALIGN + ALIGN // 2, 4 * ALIGN)  # a part unit at the end: unused
    assert a.half == 2 * ALIGN
    got = [a.take(n) for n in (1, ALIGN + 1, 3 * ALIGN, 4 * ALIGN)]
    # aligned first fit: 1 unit, 2 units, 3 units; 4 units no longer fit in the 2 left
    assert got == [base, base + ALIGN, base + 3 * ALIGN, None]
    assert a.take(4 * ALIGN + 1) is None  # over slice_bytes: never
    a.give(base + ALIGN)
    a.give(base + ALIGN)  # twice: once
    assert a.free == 4 * ALIGN
    assert a.take(2 * ALIGN) == base + ALIGN  # the gap it left
    for start in (base, base + ALIGN, base + 3 * ALIGN):
        a.give(start)
    assert a.free == 8 * ALIGN and a._gaps == [(base, 8 * ALIGN)]  # one gap again
    assert Arena(0, 100, 0).take(1) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_arena_pieces_never_overlap_and_all_come_back(ops: list[tuple[bool, int]]) -> None:
    base, size = 1 << 30, 16 * ALIGN
    a = Arena(base, size, 5 * ALIGN)
    held: dict[int, int] = {}
    for take, n in ops:
        if take or not held:
            start = a.take(n)
            if start is None:
                # only when no gap of the aligned size is left
                assert all(g[1] < -(-n // ALIGN) * ALIGN for g in a._gaps)
                continue
            end = start + -(-n // ALIGN) * ALIGN
            assert base <= start and end <= base + size
            assert all(end <= s or start >= s + m for s, m in held.items())
            held[start] = end - start
        else:
            start = sorted(held)[n % len(held)]
            a.give(start)
            del held[start]
            assert a.free == size - sum(held.values())
    for start in list(held):
        a.give(start)
    assert a.free == size and len(a._gaps) == 1
