"""Same-process byte copies through torch: how staging packs and unpacks memory on a GPU.

numpy cannot reach device memory, so a Session whose regions live on
``cuda:N`` copies its staged pieces with torch kernels instead. The pieces
are grouped by length exactly as the numpy copier groups them
(``copier.groups``), and each side of a group becomes one tensor over the
memory it touches: pieces at a constant stride are a strided ``(pieces,
items)`` view copied in one statement; pieces a whole number of lengths
apart are rows of a contiguous ``(rows, items)`` view, gathered with
``index_select`` and scattered with ``index_copy_``; any others are indexed
item by item. Python works per group and per chunk, never per piece.

The only device-specific step is making a tensor over an address range
(``__cuda_array_interface__`` on a GPU, a numpy view on the host), so the
same code runs on host memory (``copier_for("cpu", using="torch")``), where
it is tested against the numpy copier. torch is imported when a copier is
made, never when this module is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np

from .copier import _Span, groups
from .errors import CapabilityError
from .manifest import parse_device
from .rawmemory import raw_array

if TYPE_CHECKING:
    import torch

HOST_CHUNK_BYTES: Final = 1 << 20
"""Bytes per indexing statement on the host: temporaries stay in cache, as for numpy."""

CUDA_CHUNK_BYTES: Final = 64 << 20
"""Bytes per kernel on a GPU: a launch costs microseconds, so chunks are large (no cache to fit)."""

_TYPESTR: Final = {8: "<i8", 4: "<i4", 2: "<i2", 1: "|u1"}
"""Items by width: integer copies move bits unchanged."""


class _CudaInterface:
    """Device memory as torch reads it: the CUDA array interface (version 2, no stream)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, count: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "version": 2,
            "data": (addr, False),
            "shape": (count,),
            "typestr": typestr,
        }


def _torch(device: str) -> Any:
    try:
        import torch
    except ImportError:
        raise CapabilityError(
            f"no copier for device {device!r}: torch is not installed "
            "(pip install 'xferkit[torch]', or torch itself)",
            subject=device,
        ) from None
    return torch


class TorchCopier:
    """Copies through torch on one device (``cuda:N``, or ``cpu`` to run the same code)."""

    def __init__(self, device: str) -> None:
        try:
            kind, index = parse_device(device)
        except ValueError as e:
            raise CapabilityError(f"no copier for device {device!r}: {e}", subject=device) from None
        torch = self._torch = _torch(device)
        if kind == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= count:
                raise CapabilityError(
                    f"no copier for device {device!r}: torch sees {count} CUDA device"
                    f"{'s' * (count != 1)} (torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda or 'not built'})",
                    subject=device,
                )
        self.device = device
        self._cuda = kind == "cuda"
        self._torch_device = torch.device(device)
        self._chunk = CUDA_CHUNK_BYTES if self._cuda else HOST_CHUNK_BYTES

    def __repr__(self) -> str:
        return f"TorchCopier({self.device!r})"

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Copy every piece, and return once the bytes are in place (a GPU is synchronized:
        a driver posts the staged memory next, outside any stream's order)."""
        copied = False
        for s, d, length in groups(src, dst, nbytes):
            self._group(s, d, length)
            copied = True
        if copied and self._cuda:
            self._torch.cuda.synchronize(self._torch_device)

    def tensor(self, addr: int, nbytes: int, item: int) -> torch.Tensor:
        """A 1-D tensor of ``item``-byte integers over ``[addr, addr + nbytes)`` on this device:
        the one step that differs between host and device memory."""
        torch, count, typestr = self._torch, nbytes // item, _TYPESTR[item]
        if self._cuda:
            out = torch.as_tensor(_CudaInterface(addr, count, typestr), device=self._torch_device)
        else:
            out = torch.from_numpy(raw_array(addr, (count,), typestr))
        if count and out.data_ptr() != addr:  # a copy elsewhere would lose every write
            raise CapabilityError(
                f"torch copied memory at {addr:#x} instead of viewing it on {self.device}",
                subject=self.device,
            )
        return out

    def _group(self, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        s_span, d_span = _Span.of(src, length), _Span.of(dst, length)
        item = min(s_span.word, d_span.word)
        s, d = _Side(self, src, s_span, item), _Side(self, dst, d_span, item)
        if s.rows is None and d.rows is None:  # both at constant strides: one strided copy
            d.view.copy_(s.view)
            return
        # index_select gathers straight into the destination when that is contiguous memory.
        into = d.rows is None and not s.items and d.view.is_contiguous()
        n, step = len(src), max(1, self._chunk // length)
        for i in range(0, n, step):
            j = min(n, i + step)
            if into:
                self._torch.index_select(s.view, 0, s.index(i, j), out=d.view[i:j])
            else:
                d.write(i, j, s.read(i, j))


class _Side:
    """One side of a group as a tensor, and how a chunk of its pieces is reached.

    ``rows`` is None for pieces at a constant non-negative stride: a strided
    ``(pieces, items)`` view, sliced. Pieces a whole number of lengths apart
    (descending strides too) are rows of a contiguous ``(rows, items)`` view,
    ``rows`` giving each piece's. Pieces anywhere else are reached item by item
    in a flat view (``items`` set: each piece's item indices, row by row).
    """

    __slots__ = ("items", "owner", "rows", "view")

    def __init__(self, owner: TorchCopier, addrs: np.ndarray, span: _Span, item: int) -> None:
        self.owner, length = owner, span.length
        per = length // item
        self.rows: np.ndarray | None = None
        self.items = False
        stride = span.stride
        if stride is not None and stride >= 0:
            n = len(addrs)
            flat = owner.tensor(int(addrs[0]), (n - 1) * stride + length, item)
            self.view = flat.as_strided((n, per), (stride // item, 1))
            return
        signed = addrs.view(np.int64)
        lo, hi = int(signed.min()), int(signed.max()) + length
        offsets = signed - lo
        grid = span.grid if stride is None else stride % length == 0
        self.view = owner.tensor(lo, hi - lo, item)
        if grid:
            self.view = self.view.view(-1, per)
            self.rows = offsets // length
        else:
            self.items = True
            self.rows = (offsets // item)[:, None] + np.arange(per, dtype=np.int64)

    def index(self, start: int, stop: int) -> torch.Tensor:
        """Pieces ``[start, stop)``'s rows (or items) in this side's view, on the device."""
        assert self.rows is not None
        index = self.owner._torch.from_numpy(np.ascontiguousarray(self.rows[start:stop]))
        return index.to(self.owner._torch_device) if self.owner._cuda else index

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Pieces ``[start, stop)`` as a ``(pieces, items)`` tensor (a view where it can be)."""
        if self.rows is None:
            return self.view[start:stop]
        if self.items:
            return self.view[self.index(start, stop)]
        return self.owner._torch.index_select(self.view, 0, self.index(start, stop))

    def write(self, start: int, stop: int, values: torch.Tensor) -> None:
        """Write a ``(pieces, items)`` tensor into pieces ``[start, stop)``."""
        if self.rows is None:
            self.view[start:stop].copy_(values)
        elif self.items:
            self.view.index_put_((self.index(start, stop),), values)
        else:
            self.view.index_copy_(0, self.index(start, stop), values)
