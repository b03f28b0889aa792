"""Which device ``Region.from_array`` names for a ``__cuda_array_interface__`` object.

The fakes expose exactly the protocols CuPy and numba arrays do (the interface dict and,
for CuPy, ``__dlpack_device__``): that surface is what xferkit reads, no driver is involved.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xferkit import Manifest, ManifestError, Region

ADDR = 0x7F0000001000


class DLDeviceType(enum.IntEnum):  # as CuPy returns it
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLROCM = 10
    kDLCUDAManaged = 13


class CudaArray:
    """``__cuda_array_interface__`` only (a numba device array)."""

    def __init__(self) -> None:
        self.__cuda_array_interface__ = {
            "shape": (6, 4, 8),
            "typestr": "<f2",
            "data": (ADDR, False),
            "strides": None,
            "version": 3,
        }


class DLPackCudaArray(CudaArray):
    """The interface and ``__dlpack_device__`` (a CuPy array)."""

    def __init__(self, answer: Any) -> None:
        super().__init__()
        self.answer = answer

    def __dlpack_device__(self) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def device_of(obj: object, **kwargs: Any) -> str:
    return Region.from_array(obj, pool="state", name="conv", layer=7, **kwargs).device


def raises_naming(*parts: str) -> pytest.RaisesExc[ManifestError]:
    pattern = "".join(f"(?=.*{re.escape(s)})" for s in ("state/conv[7]", *parts))
    return pytest.raises(ManifestError, match=re.compile(pattern, re.S))


@given(
    kind=st.sampled_from([2, 13, DLDeviceType.kDLCUDA, DLDeviceType.kDLCUDAManaged]),
    index=st.integers(0, 1023),
)
def test_cuda_and_managed_memory_name_the_gpu_dlpack_gives(kind: int, index: int) -> None:
    obj = DLPackCudaArray((kind, index))
    region = Region.from_array(obj, pool="state", name="conv", layer=7)
    assert region.device == f"cuda:{index}"
    assert (region.addr, region.nbytes) == (ADDR, 6 * 4 * 8 * 2)
    assert Manifest.build([region]).regions[0].device == f"cuda:{index}"


def test_pinned_host_memory_is_cpu_memory() -> None:
    """kDLCUDAHost: page-locked host RAM, which the CPU reads and drivers register as host."""
    assert device_of(DLPackCudaArray((DLDeviceType.kDLCUDAHost, 0))) == "cpu"


def test_without_dlpack_the_gpu_cannot_be_known_and_cuda_0_is_assumed() -> None:
    assert device_of(CudaArray()) == "cuda:0"
    assert device_of(CudaArray(), device="cuda:5") == "cuda:5"


@pytest.mark.parametrize(("kind", "name"), [(1, "kDLCPU"), (10, "kDLROCM"), (99, "unknown")])
def test_other_dlpack_device_types_are_refused_naming_the_type(kind: int, name: str) -> None:
    with raises_naming(f"device type {kind} ({name})", "kDLCUDA"):
        device_of(DLPackCudaArray((kind, 0)))


def test_a_negative_device_id_is_refused() -> None:
    with raises_naming("'cuda:-1'", "'cpu' nor 'cuda:N'"):
        device_of(DLPackCudaArray((2, -1)))


@pytest.mark.parametrize("answer", [RuntimeError("no context"), "cuda", (2,), (2, "x"), None])
def test_a_dlpack_device_that_raises_or_is_malformed_is_a_manifest_error(answer: Any) -> None:
    with raises_naming("cannot describe DLPackCudaArray"):
        device_of(DLPackCudaArray(answer))


def test_an_explicit_device_is_not_second_guessed() -> None:
    """``device=`` wins: ``__dlpack_device__`` is not even asked (here it would raise)."""
    assert device_of(DLPackCudaArray(RuntimeError("never asked")), device="cuda:2") == "cuda:2"
    assert device_of(DLPackCudaArray((10, 0)), device="cuda:1") == "cuda:1"
    with raises_naming("device ''"):
        device_of(CudaArray(), device="")


def test_host_arrays_with_dlpack_stay_cpu() -> None:
    a = np.zeros((4, 8), np.uint8)  # numpy has __dlpack_device__ (kDLCPU) too
    assert device_of(a) == "cpu"
