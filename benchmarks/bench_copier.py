"""The local copier (xferkit.copier) against numpy's strided copy and a plain memcpy.

Prints a table and writes benchmarks/results/copier.json. Each case moves half
of a 128 MiB buffer's rows (256-byte rows: a page's heads; 16-byte rows: the
worst case for per-piece cost) into a packed staging buffer (pack) or back
(unpack): every other row (the NHD 4->8 shape, a constant stride), a random
half in order (pages scattered through a pool), or a random half in random
order on both sides (general); and staging unpacked into 8 KiB pages at random
places, a 512-byte row at a time or a page at a time (``pages``). Beside each:
``np.copyto`` of the every-other-row strided view (what a copier that knew the
layout could do), the torch copier on the same host memory
(``copier_for("cpu", using="torch")``: the code a GPU's staging runs, here on
the CPU) and one memcpy of as many bytes (the ceiling), measured in the same run.
Run: `python benchmarks/bench_copier.py`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from report import Column, script, timed

from xferkit.copier import copier_for, copy_pieces

MIB = 1 << 20
PAGE = 8 << 10


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _case(
    rng: np.random.Generator, big: np.ndarray, stage: np.ndarray, length: int, pattern: str
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], Callable[[], object]]:
    """The copier's arguments, and the strided np.copyto that moves as many bytes."""
    count = stage.size // length
    if pattern == "scattered":  # half of the rows, in order: pages scattered through a pool
        rows = np.sort(rng.choice(2 * count, count, replace=False)).astype(np.uint64)
    elif pattern == "shuffled":  # half of the rows, in any order
        rows = rng.permutation(2 * count)[:count].astype(np.uint64)
    else:  # every other row: one TP rank's heads in an NHD page (4 -> 8)
        rows = np.arange(0, 2 * count, 2, dtype=np.uint64)
    pool = np.uint64(_addr(big)) + rows * np.uint64(length)
    packed = np.arange(count, dtype=np.uint64)
    if pattern == "shuffled":
        packed = rng.permutation(packed)
    packed = np.uint64(_addr(stage)) + packed * np.uint64(length)
    nbytes = np.full(count, length, dtype=np.uint64)
    grid = big.reshape(count, 2, length)[:, 0, :]
    flat = stage.reshape(count, length)
    return (pool, packed, nbytes), functools.partial(np.copyto, flat, grid)


CASES = [
    ("pack", "every-other"),
    ("unpack", "every-other"),
    ("pack", "scattered"),
    ("unpack", "scattered"),
    ("general", "shuffled"),
]


def run(size_mib: int, repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, size_mib * MIB, dtype=np.uint8)
    half = size_mib * MIB // 2
    stage = np.zeros(half, dtype=np.uint8)
    other = np.ones(half, dtype=np.uint8)

    def memcpy() -> None:  # the same bytes, one call: the ceiling
        ctypes.memmove(_addr(stage), _addr(other), half)

    torch_copier = copier_for("cpu", using="torch")  # needs the torch extra

    def row(case: str, pattern: str, args: tuple, strided: Callable[[], object] | None) -> dict:
        copier = timed(functools.partial(copy_pieces, *args), repeat, warm=True)
        torch = timed(functools.partial(torch_copier.copy, *args), repeat, warm=True)
        copyto = timed(strided, repeat, warm=True).median if strided else float("nan")
        return {
            "case": case,
            "pattern": pattern,
            "pieces": len(args[2]),
            "bytes": half,
            "copier_gbps": half / copier.median / 1e9,
            "copier_best_gbps": half / copier.best / 1e9,
            "torch_gbps": half / torch.median / 1e9,
            "copyto_strided_gbps": half / copyto / 1e9,
            "memcpy_gbps": half / timed(memcpy, repeat, warm=True).median / 1e9,
            "copier_ms": copier.median * 1e3,
        }

    rows = []
    for length in (256, 16):
        for direction, pattern in CASES:
            (pool, packed, nbytes), strided = _case(rng, big, stage, length, pattern)
            args = (packed, pool, nbytes) if direction == "unpack" else (pool, packed, nbytes)
            rows.append(row(f"{direction} {length} B", pattern, args, strided))
    # Staging into 8 KiB pages scattered through the pool (Llama's 16-token NHD pages at
    # decode TP 4): a row (two heads, 512 bytes) at a time, as the planner cut it before it
    # joined the pieces that follow on both sides, and a page at a time, as it does now.
    pages = rng.permutation(big.size // PAGE)[: half // PAGE].astype(np.uint64)
    at = np.uint64(_addr(big)) + pages * np.uint64(PAGE)
    for length in (512, PAGE):
        per = PAGE // length
        dst = (at[:, None] + np.arange(per, dtype=np.uint64)[None, :] * np.uint64(length)).ravel()
        src = np.uint64(_addr(stage)) + np.arange(dst.size, dtype=np.uint64) * np.uint64(length)
        args = (src, dst, np.full(dst.size, length, dtype=np.uint64))
        rows.append(row(f"unpack {length} B", "pages", args, None))
    return rows


COLUMNS = [
    Column("case", "case", width=14, left=True),
    Column("pattern", "pattern", width=13, left=True),
    Column("pieces", "pieces", ","),
    Column("MiB", lambda r: r["bytes"] / MIB, ".0f", 5),
    Column("copier GB/s", "copier_gbps", ".2f", 13),
    Column("best", "copier_best_gbps", ".2f", 7),
    Column("torch GB/s", "torch_gbps", ".2f", 12),
    Column("copyto GB/s", "copyto_strided_gbps", ".2f", 13),
    Column("memcpy GB/s", "memcpy_gbps", ".2f", 13),
    Column("copier ms", "copier_ms", ".1f", 11),
]


def main() -> None:
    script(
        "copier",
        __doc__,
        run,
        COLUMNS,
        {"size_mib": (128, "the strided buffer's size"), "repeat": (7, None)},
    )


if __name__ == "__main__":
    main()
