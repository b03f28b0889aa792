"""How xferkit's device strings map onto NIXL memory types (pure; no NIXL import)."""

from __future__ import annotations

import glob
import re

_DEVICE = re.compile(r"^(cpu|cuda:(\d+))$")


def memory_kind(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a region on ``device``.

    ``cpu`` is host memory (``DRAM``, device id 0); ``cuda:N`` is GPU memory
    (``VRAM``) on device N, the id NIXL and UCX use to find the GPU.
    """
    m = _DEVICE.match(device)
    if m is None:
        raise ValueError(f"NIXL cannot place memory on device {device!r} (cpu or cuda:N)")
    if m.group(2) is None:
        return "DRAM", 0
    return "VRAM", int(m.group(2))


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU device node exists here (cheap; no CUDA call)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))
