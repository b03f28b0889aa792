"""A driver on its own: two backends in this process, one buffer each, timed writes.

What ``bench raw`` sweeps (descriptor size x batch size, nixlbench's columns),
what ``bench calibrate`` derives a driver's declared costs from, and the
ceiling ``bench`` sets each case beside (one contiguous descriptor of a
request's size; single-core memcpy). Any installed driver works, third-party
ones included, and drivers without cross-process peers too.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..backend import Backend
from ..copier import copy_pieces
from ..descriptors import Descriptors
from ..errors import XferError
from ..manifest import Manifest, Region
from ..plugins import open_backend
from .errors import DRIVER, FAILED, BenchError

RAW_COLUMNS = (
    "Block Size (B)",
    "Batch Size",
    "B/W (GB/Sec)",
    "Avg Lat. (us)",
    "Avg Post (us)",
    "P99 Post (us)",
    "Avg Tx (us)",
    "P99 Tx (us)",
)


def open_checked(driver: str, options: dict[str, Any], *, cross_process: bool = False) -> Backend:
    """The backend, or a BenchError (DRIVER) naming why it cannot be used."""
    try:
        backend = open_backend(driver, **options)
    except XferError as exc:
        raise BenchError(DRIVER, f"driver {driver!r}: {exc}") from exc
    if cross_process and not backend.capabilities.cross_process:
        backend.close()
        raise BenchError(
            DRIVER,
            f"driver {driver!r} declares cross_process=False: xferkit bench runs every rank in "
            "its own process (bench raw and bench calibrate work in one)",
        )
    return backend


class Pair:
    """A source and a destination backend of one driver, ``nbytes`` registered on each."""

    def __init__(self, driver: str, options: dict[str, Any], nbytes: int) -> None:
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self.a = open_checked(driver, options)
        try:
            self.b = open_checked(driver, options)
        except BenchError:
            self.a.close()
            raise
        try:
            self.a.register(
                Manifest.build([Region.from_array(self.src, pool="p", name="src", layer=0)])
            )
            dm = Manifest.build([Region.from_array(self.dst, pool="p", name="dst", layer=0)])
            self.b.register(dm)
            self.peer = self.a.connect(self.b.endpoint(), dm)
        except XferError as exc:
            self.close()
            raise BenchError(DRIVER, f"driver {driver!r}: {exc}") from exc
        self.s0, self.d0 = np.uint64(self.src.ctypes.data), np.uint64(self.dst.ctypes.data)

    def descriptors(self, block: int, batch: int, stride: int | None = None) -> Descriptors:
        step = np.arange(batch, dtype=np.uint64) * np.uint64(stride or block)
        return Descriptors(self.s0 + step, self.d0 + step, np.full(batch, block, np.uint64))

    def write(self, descs: Descriptors) -> tuple[float, float]:
        """(post, completion) seconds of one write."""
        t0 = time.perf_counter()
        try:
            transfer = self.a.write(self.peer, descs)
            t1 = time.perf_counter()
            transfer.wait(600)
        except XferError as exc:
            raise BenchError(FAILED, f"driver {self.a.name!r}: {exc}") from exc
        return t1 - t0, time.perf_counter() - t1

    def check(self, block: int, batch: int, stride: int | None = None) -> bool:
        """Whether the last write of ``descs`` landed byte for byte."""
        step = stride or block
        for i in range(batch):
            lo = i * step
            if not np.array_equal(self.src[lo : lo + block], self.dst[lo : lo + block]):
                return False
        return True

    def close(self) -> None:
        for backend in (self.a, getattr(self, "b", None)):
            if backend is not None:
                backend.close()


def _iterations(nbytes: int, target: int = 64 << 20) -> int:
    return int(min(1000, max(8, target // max(nbytes, 1))))


def sweep(
    driver: str,
    options: dict[str, Any],
    blocks: list[int],
    batches: list[int],
    *,
    max_bytes: int,
    check: bool,
    tick: Any = None,
) -> list[dict[str, Any]]:
    """One row per (block, batch) whose bytes fit ``max_bytes``: nixlbench's columns."""
    combos = [(b, n) for b in blocks for n in batches if b * n <= max_bytes]
    pair = Pair(driver, options, max(b * n for b, n in combos))
    rows = []
    try:
        for block, batch in combos:
            descs = pair.descriptors(block, batch)
            pair.write(descs)  # warm
            posts, txs = [], []
            iters = _iterations(block * batch)
            for i in range(iters):
                if check and i == iters - 1:
                    pair.dst[: block * batch] = 0
                post, tx = pair.write(descs)
                posts.append(post)
                txs.append(tx)
            lat = np.add(posts, txs)
            row: dict[str, Any] = {
                "block_bytes": block,
                "batch": batch,
                "gbps": block * batch * iters / lat.sum() / 1e9,
                "avg_lat_us": float(lat.mean() * 1e6),
                "avg_post_us": float(np.mean(posts) * 1e6),
                "p99_post_us": float(np.percentile(posts, 99) * 1e6),
                "avg_tx_us": float(np.mean(txs) * 1e6),
                "p99_tx_us": float(np.percentile(txs, 99) * 1e6),
                "checked": pair.check(block, batch) if check else None,
            }
            rows.append(row)
            if tick is not None:
                tick()
    finally:
        pair.close()
    return rows


def memcpy_gbps(nbytes: int, repeat: int = 3) -> float:
    """Single-core memcpy of ``nbytes`` (numpy copy), best of ``repeat``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def ceiling(driver: str, options: dict[str, Any], nbytes: int, repeat: int = 3) -> dict[str, float]:
    """The driver's throughput for one contiguous descriptor of ``nbytes`` and memcpy's."""
    pair = Pair(driver, options, nbytes)
    try:
        descs = pair.descriptors(nbytes, 1)
        pair.write(descs)
        best = min(sum(pair.write(descs)) for _ in range(repeat))
    finally:
        pair.close()
    return {"bytes": nbytes, "driver_gbps": nbytes / best / 1e9, "memcpy_gbps": memcpy_gbps(nbytes)}


def calibrate(driver: str, options: dict[str, Any], repeat: int = 5) -> dict[str, Any]:
    """The ``descriptor_bytes`` and ``copy_cost`` this driver should declare, measured.

    descriptor_bytes: seconds per 64-byte descriptor (16384 of them, one per 4 KiB page, so
    nothing merges) times the bandwidth of one 64 MiB descriptor; copy_cost: that bandwidth
    over the local copier's, packing 256 of every 512 bytes as a heterogeneous-TP pack does.
    """
    big, small, n = 64 << 20, 64, 16384
    pair = Pair(driver, options, big)
    try:
        many = pair.descriptors(small, n, stride=4096)
        one = pair.descriptors(big, 1)
        pair.write(many)
        pair.write(one)
        t_many = min(sum(pair.write(many)) for _ in range(repeat))
        t_one = min(sum(pair.write(one)) for _ in range(repeat))
        landed = pair.check(small, n, stride=4096)
        declared = pair.a.capabilities
        rows = np.arange(big // 512, dtype=np.uint64)
        rows = rows[np.random.default_rng(0).permutation(rows.size)]
        pack = (
            pair.s0 + rows * np.uint64(512),
            pair.d0 + np.arange(rows.size, dtype=np.uint64) * np.uint64(256),
            np.full(rows.size, 256, np.uint64),
        )
        t_copy = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            copy_pieces(*pack)
            t_copy = min(t_copy, time.perf_counter() - t)
    finally:
        pair.close()
    per_desc, bw, copy_bw = t_many / n, big / t_one, big / 2 / t_copy
    return {
        "driver": driver,
        "options": options,
        "us_per_descriptor": per_desc * 1e6,
        "large_gbps": bw / 1e9,
        "copier_gbps": copy_bw / 1e9,
        "descriptor_bytes": int(per_desc * bw),
        "copy_cost": round(bw / copy_bw, 3),
        "declared": {
            "descriptor_bytes": declared.descriptor_bytes,
            "copy_cost": declared.copy_cost,
        },
        "landed": landed,
    }
