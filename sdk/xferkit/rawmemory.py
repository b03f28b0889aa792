"""A numpy array over raw memory at an address, through the array interface.

The one wrapper for memory numpy did not allocate (a sealed set's bytes, a
registered region's pieces): no ctypes array type is made per size or shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class _Interface:
    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def raw_array(
    addr: int, shape: tuple[int, ...], typestr: str, strides: tuple[int, ...] | None = None
) -> np.ndarray:
    """A writable array of ``shape`` (C order unless ``strides``, in bytes) at ``addr``."""
    interface: dict[str, Any] = {
        "version": 3,
        "data": (addr, False),
        "shape": shape,
        "typestr": typestr,
    }
    if strides is not None:
        interface["strides"] = strides
    return np.asarray(_Interface(interface))
