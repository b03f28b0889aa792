"""Whole pages staged between pools and staging, by where each buffer starts within a page.

glibc's ``memcpy`` (``rep movsb``, for pieces of a few KiB and more) runs at a third of its
speed on this VM's AMD EPYC when the destination lies a few bytes ahead of the source modulo
4 KiB. Pools start 0 (page-aligned: pinned or mapped memory), 16 (numpy) or 64 (torch)
bytes past a page; whole pages staged keep staging's own offset. Each case packs
``--mib`` of random 16 KiB pages of a 512 MiB pool into staging (``copy_pieces``, as a
Session's pack worker does) and unpacks them back, with staging as a Session places it
(``Staging``) and as numpy alone would (``np.empty``: 16 bytes past a page), the two
alternating ``--repeat`` times in one run. Run: `python benchmarks/bench_placement.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from report import Column, script, timed

from xferkit.copier import copy_pieces
from xferkit.manifest import Manifest
from xferkit.session.rounds import HOST_PAGE, Staging, host_buffer

MIB = 1 << 20
PAGE = 16 << 10
POOL = 512 * MIB


def run(mib: int, repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    nbytes = mib * MIB
    stagings = {
        "Session": Staging(Manifest((), 0, 1), nbytes).buffer,
        "numpy": host_buffer(nbytes, 16),
    }
    count = nbytes // PAGE
    lengths = np.full(count, PAGE, dtype=np.uint64)
    rows = []
    for pool_at in (0, 16, 64):
        pool = host_buffer(POOL, pool_at)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(repeat):  # alternating: the machine's drift hits both placements
            for name, staging in stagings.items():
                pages = rng.choice(POOL // PAGE, count, replace=False).astype(np.uint64)
                at = np.uint64(pool.ctypes.data) + pages * np.uint64(PAGE)
                packed = np.uint64(staging.ctypes.data) + np.arange(count, dtype=np.uint64) * (
                    np.uint64(PAGE)
                )
                for way, (src, dst) in (("pack", (at, packed)), ("unpack", (packed, at))):
                    t = timed(functools.partial(copy_pieces, src, dst, lengths))
                    times.setdefault((name, way), []).extend(t)
        for name, staging in stagings.items():
            pack, unpack = (np.array(times[name, way]) for way in ("pack", "unpack"))
            rows.append(
                {
                    "pool_offset": pool_at,
                    "staging": name,
                    "staging_offset": int(staging.ctypes.data) % HOST_PAGE,
                    "bytes": nbytes,
                    "pack_gbps": nbytes / float(np.median(pack)) / 1e9,
                    "pack_best_gbps": nbytes / float(pack.min()) / 1e9,
                    "unpack_gbps": nbytes / float(np.median(unpack)) / 1e9,
                    "unpack_best_gbps": nbytes / float(unpack.min()) / 1e9,
                }
            )
        del pool
    return rows


COLUMNS = [
    Column("pool at", "pool_offset", "d", 8),
    Column("staging", "staging", width=9, left=False),
    Column("at", "staging_offset", "d", 6),
    Column("pack GB/s", "pack_gbps", ".2f", 11),
    Column("best", "pack_best_gbps", ".2f", 7),
    Column("unpack GB/s", "unpack_gbps", ".2f", 13),
    Column("best", "unpack_best_gbps", ".2f", 7),
]


def main() -> None:
    script(
        "placement",
        __doc__,
        run,
        COLUMNS,
        {"mib": (32, "bytes staged per copy, MiB"), "repeat": (7, None)},
    )


if __name__ == "__main__":
    main()
