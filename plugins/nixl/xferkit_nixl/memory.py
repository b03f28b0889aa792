"""xferkit's devices and descriptors as NIXL memory types and lists (pure; no NIXL import)."""

from __future__ import annotations

import glob
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from xferkit.driver import Descriptors, parse_device

Kind = tuple[str, int]
"""A NIXL memory type and device id: ``("DRAM", 0)``, ``("VRAM", 3)``."""


def memory_kind(device: str) -> Kind:
    """NIXL memory type and device id of a region on ``device`` (ValueError unless cpu, cuda:N).

    ``cpu`` is host memory (``DRAM``, device id 0); ``cuda:N`` is GPU memory
    (``VRAM``) on device N, the id NIXL and UCX use to find the GPU.
    """
    kind, index = parse_device(device)
    return ("DRAM", 0) if kind == "cpu" else ("VRAM", index)


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU device node exists here (cheap; no CUDA call)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


class Kinds(NamedTuple):
    """The memory kind of each region of one side: ``kinds[codes[locate(addrs)]]``.

    ``locate`` is the side's address lookup (``Manifest.locate`` or an
    ``AddressTable``'s), giving the index of the region holding each address.
    """

    kinds: list[Kind]
    codes: np.ndarray
    locate: Callable[[np.ndarray], np.ndarray]

    @classmethod
    def of(cls, devices: Sequence[str], locate: Callable[[np.ndarray], np.ndarray]) -> Kinds:
        """From each region's device, in the order ``locate`` numbers the regions."""
        names, codes = np.unique(np.array(devices, dtype=str), return_inverse=True)
        return cls([memory_kind(str(d)) for d in names], codes, locate)


def split_by_kind(
    here: Kinds, there: Kinds, d: Descriptors
) -> list[tuple[Kind, Kind, Descriptors]]:
    """Descriptors grouped by (local kind, remote kind): one NIXL list holds one memory type."""
    if len(here.kinds) == 1 and len(there.kinds) == 1:
        return [(here.kinds[0], there.kinds[0], d)]
    n = len(there.kinds)
    key = here.codes[here.locate(d.src)] * n + there.codes[there.locate(d.dst)]
    return [
        (here.kinds[k // n], there.kinds[k % n], Descriptors(d.src[m], d.dst[m], d.nbytes[m]))
        for k in np.unique(key).tolist()
        for m in [key == k]
    ]


def rows(addrs: np.ndarray, nbytes: np.ndarray, devid: int) -> np.ndarray:
    """NIXL's Nx3 (address, length, device id) array for one side.

    Filled by column into an array of its own: np.stack costs several times
    more with caches cold after a large copy, and nixlXferDList converts a view
    into a shared (2, N, 3) array about ten times slower.
    """
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = devid
    return out
