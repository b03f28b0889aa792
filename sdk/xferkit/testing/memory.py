"""Small real buffers, manifests and hand-made descriptors for tests of backends and drivers."""

from __future__ import annotations

import numpy as np

from ..descriptors import Descriptors
from ..manifest import Manifest, Region


def random_bytes(size: int, seed: int) -> np.ndarray:
    """``size`` random bytes, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def manifest_of(arrays: list[np.ndarray], name: str, pool: str = "p") -> Manifest:
    """One region per array, in pools ``{pool}0``, ``{pool}1``... (labels ``p0/{name}[0]``)."""
    return Manifest.build(
        [Region.from_array(a, pool=f"{pool}{i}", name=name, layer=0) for i, a in enumerate(arrays)]
    )


def descriptors(src: list[int], dst: list[int], nbytes: list[int]) -> Descriptors:
    """Hand-made (unsealed) descriptors from three lists."""
    return Descriptors(*(np.array(x, dtype=np.uint64) for x in (src, dst, nbytes)))
