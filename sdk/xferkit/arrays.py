"""What a tensor-like object is in memory: address, shape, itemsize, contiguity, device.

Duck-typed (torch tensors, ``__array_interface__``, ``__cuda_array_interface__``),
without importing torch; ``Region.from_array`` is its one user. ``c_strides`` is the one
C-order stride rule (contiguity here, the planner's byte pieces).

The device, when the caller does not give one:

- a torch tensor says it: ``str(tensor.device)`` (``cpu``, ``cuda:N``; anything else, such
  as ``meta`` or ``mps``, is refused by ``Region.from_array``);
- an ``__array_interface__`` object is host memory: ``cpu``;
- a ``__cuda_array_interface__`` object (CuPy, numba) does not say which GPU in that
  interface, so its ``__dlpack_device__()`` is asked when it has one: DLPack type 2
  (kDLCUDA) and 13 (kDLCUDAManaged) are ``cuda:N`` with N its device id, 3 (kDLCUDAHost,
  pinned host memory the CPU reads and writes directly) is ``cpu``, any other type is
  refused. Without ``__dlpack_device__`` the GPU cannot be known and ``cuda:0`` is
  assumed: pass ``device=`` for memory on another GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ManifestError

Description = tuple[int, tuple[int, ...], int, bool, str]
"""(address, shape, itemsize, C-contiguous, device)."""

_DLPACK_DEVICES = {2: "cuda", 13: "cuda", 3: "cpu"}
"""DLPack device types a ``__cuda_array_interface__`` object may name, as a Region's device."""

_DLPACK_NAMES = {
    1: "kDLCPU",
    4: "kDLOpenCL",
    7: "kDLVulkan",
    8: "kDLMetal",
    10: "kDLROCM",
    11: "kDLROCMHost",
    14: "kDLOneAPI",
}
"""Names of the DLPack device types refused, for the message."""


def describe(
    array: Any, key: tuple[Any, ...], label: str, device: str | None = None
) -> Description:
    """(address, shape, itemsize, C-contiguous, device) of a writable tensor-like object.

    ``device``, when given, is the answer for the device: the object is not asked.
    """
    try:
        return _interface(array, key, label, device)
    except ManifestError:
        raise
    except Exception as exc:  # a malformed interface dict, a shape that is not ints...
        raise ManifestError(
            f"region {label}: cannot describe {type(array).__name__}: {type(exc).__name__}: {exc}",
            subject=key,
        ) from exc


def _interface(array: Any, key: tuple[Any, ...], label: str, device: str | None) -> Description:
    if hasattr(array, "data_ptr") and hasattr(array, "element_size"):  # torch.Tensor
        lazy = [f for f in ("is_conj", "is_neg") if getattr(array, f, lambda: False)()]
        if lazy:
            raise ManifestError(
                f"region {label}: the tensor is a lazy {lazy[0][3:]} view ({lazy[0]}() is "
                "True): its memory holds other values than it shows, so the bytes a peer "
                "reads or writes would not be its values; register the tensor it is a view of",
                subject=key,
            )
        return (
            int(array.data_ptr()),
            tuple(int(n) for n in array.shape),
            int(array.element_size()),
            bool(array.is_contiguous()),
            str(array.device) if device is None else device,
        )
    for attr in ("__cuda_array_interface__", "__array_interface__"):
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
        if device is None:
            device = "cpu" if attr == "__array_interface__" else _cuda_device(array, key, label)
        return int(ptr or 0), shape, dtype.itemsize, contiguous, device
    raise ManifestError(
        f"region {label}: {type(array).__name__} is neither a torch tensor nor exposes "
        "__array_interface__ / __cuda_array_interface__",
        subject=key,
    )


def _cuda_device(array: Any, key: tuple[Any, ...], label: str) -> str:
    """The device of a ``__cuda_array_interface__`` object (the rule in the module docstring)."""
    ask = getattr(array, "__dlpack_device__", None)
    if ask is None:
        return "cuda:0"
    kind, index = (int(n) for n in ask())
    found = _DLPACK_DEVICES.get(kind)
    if found is None:
        name = _DLPACK_NAMES.get(kind, "unknown")
        raise ManifestError(
            f"region {label}: __dlpack_device__() says device type {kind} ({name}); only CUDA "
            "(kDLCUDA, kDLCUDAManaged) and pinned host (kDLCUDAHost) memory is registered",
            subject=key,
        )
    return "cpu" if found == "cpu" else f"cuda:{index}"


def c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Byte strides of a C-contiguous array of ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]
