"""What a tensor-like object is in memory: address, shape, itemsize, contiguity, device.

Duck-typed (torch tensors, ``__array_interface__``, ``__cuda_array_interface__``),
without importing torch; ``Region.from_array`` is its one user. ``c_strides`` is the one
C-order stride rule (contiguity here, the planner's byte pieces).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ManifestError


def describe(
    array: Any, key: tuple[Any, ...], label: str
) -> tuple[int, tuple[int, ...], int, bool, str]:
    """(address, shape, itemsize, C-contiguous, device) of a writable tensor-like object."""
    try:
        return _interface(array, key, label)
    except ManifestError:
        raise
    except Exception as exc:  # a malformed interface dict, a shape that is not ints...
        raise ManifestError(
            f"region {label}: cannot describe {type(array).__name__}: {type(exc).__name__}: {exc}",
            subject=key,
        ) from exc


def _interface(
    array: Any, key: tuple[Any, ...], label: str
) -> tuple[int, tuple[int, ...], int, bool, str]:
    if hasattr(array, "data_ptr") and hasattr(array, "element_size"):  # torch.Tensor
        return (
            int(array.data_ptr()),
            tuple(int(n) for n in array.shape),
            int(array.element_size()),
            bool(array.is_contiguous()),
            str(array.device),
        )
    for attr, device in (("__cuda_array_interface__", "cuda:0"), ("__array_interface__", "cpu")):
        face = getattr(array, attr, None)
        if face is None:
            continue
        dtype = np.dtype(face["typestr"])
        if dtype.hasobject:
            raise ManifestError(
                f"region {label}: dtype {dtype} holds Python object pointers; a transfer "
                "would overwrite them",
                subject=key,
            )
        ptr, readonly = face["data"]
        if readonly:
            raise ManifestError(
                f"region {label}: the array is read-only; peers write into registered memory",
                subject=key,
            )
        shape = tuple(int(n) for n in face["shape"])
        strides = face.get("strides")
        contiguous = strides is None or all(
            n == 1 or s == c
            for n, s, c in zip(shape, strides, c_strides(shape, dtype.itemsize), strict=True)
        )
        return int(ptr or 0), shape, dtype.itemsize, contiguous, device
    raise ManifestError(
        f"region {label}: {type(array).__name__} is neither a torch tensor nor exposes "
        "__array_interface__ / __cuda_array_interface__",
        subject=key,
    )


def c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Byte strides of a C-contiguous array of ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]
