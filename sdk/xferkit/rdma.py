"""Which RDMA devices the kernel exposes (sysfs): what several drivers ask before starting."""

from __future__ import annotations

import os

INFINIBAND = "/sys/class/infiniband"


def rdma_devices(root: str = INFINIBAND) -> dict[str, str]:
    """RDMA devices the kernel exposes, by name, with their kernel driver ("" when unknown)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            out[name] = os.path.basename(os.readlink(os.path.join(root, name, "device", "driver")))
        except OSError:
            out[name] = ""
    return out
