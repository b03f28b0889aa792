"""Checks on descriptors and whole handoffs, independent of the planner's own arithmetic.

The reference model (``Reference``) says which bytes must land where; these
helpers check the descriptors themselves (no zero length, each inside one
region of the same key on both sides, no two mergeable, count equal to the
number of maximal contiguous runs of the byte mapping) and ``handoff`` runs a
whole request plan -> expand -> check -> write -> compare, through any writer
(plain copies by default, or a real backend).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from ..descriptors import Descriptors
from ..manifest import STAGING_POOL, Manifest, Region
from ..planner import coverage
from ..staging import COPY_COST, Force, stage
from .reference import Reference, WriteCounter, execute, page_pairs

Request = Mapping[str, tuple[object, object]]
"""A model-wide request: ``{pool: (source slots, destination slots)}``."""

Writer = Callable[[int, int, Descriptors], object]
"""``write(src_index, dst_index, descs)``: move ``descs`` from source rank to destination rank."""

P = TypeVar("P")

BYTE_LEVEL_LIMIT = 1 << 20
"""Bytes a brute-force byte mapping may expand to; larger batches skip the run count."""


def for_rank(m: Manifest, request: Mapping[str, P]) -> dict[str, P]:
    """The part of a model-wide request that one destination rank (one PP stage) has pools for."""
    have = set(m.pools) | {k[0] for k in m.dropped_keys}
    return {pool: pair for pool, pair in request.items() if pool in have}


def _regions(m: Manifest, addr: np.ndarray, nbytes: np.ndarray, side: str) -> np.ndarray:
    """Index in ``m.regions`` of the region holding each piece; asserts one holds it whole."""
    idx = m.locate(addr, nbytes)
    bad = np.flatnonzero(idx < 0)
    assert not bad.size, (
        f"{side} descriptor {int(bad[0])} [{int(addr[bad[0]]):#x}, +{int(nbytes[bad[0]])}) "
        "is not inside one region"
    )
    return idx


def byte_runs(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, region: np.ndarray
) -> tuple[int, int]:
    """(number of maximal runs, number of bytes) of the byte mapping the copies describe.

    Brute force: every byte becomes (region, dst, src); a run continues where
    the next destination byte of the same region comes from the next source byte.
    Asserts no destination byte appears twice.
    """
    total = int(nbytes.sum())
    if total == 0:
        return 0, 0
    n = nbytes.astype(np.int64)
    first = np.repeat(np.cumsum(n) - n, n)
    step = np.arange(total, dtype=np.int64) - first
    d = np.repeat(dst.astype(np.int64), n) + step
    s = np.repeat(src.astype(np.int64), n) + step
    g = np.repeat(region, n)
    order = np.lexsort((d, g))
    d, s, g = d[order], s[order], g[order]
    assert not np.any((g[1:] == g[:-1]) & (d[1:] == d[:-1])), "a destination byte is copied twice"
    cont = (g[1:] == g[:-1]) & (d[1:] == d[:-1] + 1) & (s[1:] == s[:-1] + 1)
    return int(total - cont.sum()), total


def check_descriptors(descs: Descriptors, src: Manifest, dst: Manifest) -> None:
    """Shape, no zero length, one region of the same key per descriptor, minimal count.

    Minimal: no two descriptors could be merged, and (up to ``BYTE_LEVEL_LIMIT``
    bytes) there are exactly as many as the byte mapping has maximal runs.
    """
    for a in (descs.src, descs.dst, descs.nbytes):
        assert a.dtype == np.uint64 and a.ndim == 1 and a.shape == (len(descs),)
    if not len(descs):
        return
    assert (descs.nbytes > 0).all(), "zero-length descriptor"
    si = _regions(src, descs.src, descs.nbytes, "source")
    di = _regions(dst, descs.dst, descs.nbytes, "destination")
    # The destination region of each source region's key (per region, not per descriptor).
    same_key = np.array([dst.index(k) if k in dst else -1 for k in src.keys], dtype=np.int64)
    wrong = np.flatnonzero(same_key[si] != di)
    assert not wrong.size, f"descriptor {int(wrong[0])} pairs regions of different keys"
    # No two descriptors could be merged: sorted by destination, no neighbours in the
    # same region contiguous on both sides.
    order = np.lexsort((descs.dst, di))
    s, d, n, g = descs.src[order], descs.dst[order], descs.nbytes[order], di[order]
    same = g[1:] == g[:-1]
    assert not np.any(same & (d[:-1] + n[:-1] > d[1:])), "two descriptors overlap"
    mergeable = same & (d[:-1] + n[:-1] == d[1:]) & (s[:-1] + n[:-1] == s[1:])
    assert not mergeable.any(), f"descriptors {np.flatnonzero(mergeable)[:3]} could be merged"
    if descs.total_bytes <= BYTE_LEVEL_LIMIT:
        runs, _ = byte_runs(descs.src, descs.dst, descs.nbytes, di)
        assert len(descs) == runs, f"{len(descs)} descriptors for {runs} maximal runs"


def requested_bytes(ref: Reference, dst_index: int, request: Request) -> int:
    """Bytes the reference says a destination rank receives: its shard of each requested page.

    A destination slot of ``dst_pages`` model pages receives as many of them as
    the request pairs (``page_pairs``), each ``1 / dst_pages`` of its slot.
    """
    total = 0
    for key, array in ref.dsts[dst_index].arrays.items():
        if array.size and key[0] in request:
            spec = ref.by_key[key]
            pages = len(page_pairs(spec, *request[key[0]])[0])
            total += pages * array[0].nbytes // spec.dst_pages
    return total


def _copy(src_index: int, dst_index: int, descs: Descriptors) -> None:
    execute(descs)


def handoff(ref: Reference, request: Request, write: Writer = _copy) -> dict[int, dict[int, int]]:
    """Plan, expand, check and write ``request`` into every destination rank of ``ref``.

    ``write(src_index, dst_index, descs)`` moves one source rank's descriptors
    into one destination rank and returns once they landed: plain in-memory
    copies by default; pass one that writes through a backend to test a driver
    (``src_index``/``dst_index`` index ``ref.srcs``/``ref.dsts``).

    Returns ``{dst_index: {src_index: descriptor count}}``. Asserts everything
    the planner promises: coverage names exactly the sources it plans,
    descriptors are well formed and minimal, bytes moved equal the bytes
    requested, no byte is written twice, each destination equals the
    reference (untouched outside the request) and no source byte changes.
    """
    srcs = [r.manifest for r in ref.srcs]
    before = [r.snapshot() for r in ref.srcs]
    counter = WriteCounter(ref.dsts)
    counts: dict[int, dict[int, int]] = {}
    for di, rank in enumerate(ref.dsts):
        wanted = for_rank(rank.manifest, request)
        cov = coverage(srcs, rank.manifest)
        assert set(cov.plans) == set(cov.sources)
        counts[di] = {}
        moved = 0
        for si in cov.sources:
            descs = cov.plans[si].expand(wanted)
            check_descriptors(descs, srcs[si], rank.manifest)
            counter.record(descs)
            write(si, di, descs)
            moved += descs.total_bytes
            counts[di][si] = len(descs)
        assert moved == requested_bytes(ref, di, wanted)
        ref.check(di, wanted)
    _written_once_sources_kept(counter, ref, before)
    return counts


def staged_handoff(
    ref: Reference,
    request: Request,
    *,
    force: Force = "staged",
    descriptor_bytes: int = 4096,
    copy_cost: float = COPY_COST,
    capacity: int = 1 << 20,
    copy: Callable[[Descriptors], object] = execute,
) -> dict[int, dict[int, int]]:
    """``handoff`` through staging: direct copies, then per round pack, wire, unpack.

    Staging on each side is a fresh buffer of ``capacity`` bytes refilled with
    noise before every round, so a round that reads what an earlier one left
    fails. ``copy`` runs the local pack and unpack copies (the reference
    executor by default; pass a copier to test it). Asserts each destination
    equals the reference and is untouched outside the request, no byte is
    written twice, no round overflows staging, and no source byte changes.
    Returns ``{dst_index: {src_index: wire descriptor count}}``.
    """
    srcs = [r.manifest for r in ref.srcs]
    before = [r.snapshot() for r in ref.srcs]
    counter = WriteCounter(ref.dsts)
    rng = np.random.default_rng(0)
    src_stage = np.zeros(max(capacity, 1), dtype=np.uint8)
    dst_stage = np.zeros(max(capacity, 1), dtype=np.uint8)
    counts: dict[int, dict[int, int]] = {}
    for di, rank in enumerate(ref.dsts):
        wanted = for_rank(rank.manifest, request)
        cov = coverage(srcs, rank.manifest)
        counts[di] = {}
        for si in cov.sources:
            staged = stage(
                cov.plans[si], descriptor_bytes=descriptor_bytes, copy_cost=copy_cost, force=force
            )
            out = staged.expand(wanted, src_capacity=capacity, dst_capacity=capacity)
            # The destination cuts its rounds knowing how many source slots, not which.
            blind = {
                p: (np.zeros(np.asarray(s).size, dtype=np.int64), d) for p, (s, d) in wanted.items()
            }
            dst_rounds = staged.expand(blind, src_capacity=capacity, dst_capacity=capacity).rounds
            assert len(dst_rounds) == len(out.rounds)
            check_descriptors(out.direct, srcs[si], rank.manifest)
            counter.record(out.direct)
            execute(out.direct)
            wires = len(out.direct)
            for r, seen in zip(out.rounds, dst_rounds, strict=True):
                assert r.src_bytes <= capacity and r.dst_bytes <= capacity, r
                src_stage[:] = rng.integers(0, 256, src_stage.size, dtype=np.uint8)
                dst_stage[:] = rng.integers(0, 256, dst_stage.size, dtype=np.uint8)
                # Each side computes its own copies, as a Session's do.
                copies = r.expand(src_stage.ctypes.data, dst_stage.ctypes.data, only="send")
                copy(copies.pack)
                # Each wire copy lies whole in one region of each side (staging included):
                # what every driver's registration asks of a descriptor.
                _regions(
                    with_staging(srcs[si], src_stage),
                    copies.wire.src,
                    copies.wire.nbytes,
                    "wire source",
                )
                _regions(
                    with_staging(rank.manifest, dst_stage),
                    copies.wire.dst,
                    copies.wire.nbytes,
                    "wire destination",
                )
                execute(copies.wire)
                unpack = seen.expand(
                    src_stage.ctypes.data, dst_stage.ctypes.data, only="unpack"
                ).unpack
                copy(unpack)
                landed = rank.manifest.locate(copies.wire.dst, copies.wire.nbytes) >= 0
                counter.record(_select(copies.wire, landed))
                counter.record(unpack)
                wires += len(copies.wire)
            counts[di][si] = wires
        ref.check(di, wanted)
    _written_once_sources_kept(counter, ref, before)
    return counts


def with_staging(manifest: Manifest, staging: np.ndarray) -> Manifest:
    """``manifest`` with ``staging`` registered after its regions, as a Session's is."""
    region = Region.from_array(staging, pool=STAGING_POOL, name="staging", layer=0)
    return Manifest(
        (*manifest.regions, region), manifest.tp_rank, manifest.tp_size, manifest.dropped
    )


def _written_once_sources_kept(counter: WriteCounter, ref: Reference, before: list) -> None:
    assert counter.max <= 1, f"a destination byte was written {counter.max} times"
    for rank, snap in zip(ref.srcs, before, strict=True):
        for key, array in rank.arrays.items():
            assert np.array_equal(array, snap[key]), f"source region {key} changed"


def _select(d: Descriptors, keep: np.ndarray) -> Descriptors:
    return Descriptors(d.src[keep], d.dst[keep], d.nbytes[keep])
