"""Byte copies, the unit every driver moves: three parallel uint64 arrays, sealed when a plan made them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .manifest import Manifest


class Descriptors:
    """Byte copies: ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (uint64 arrays).

    They stay in the process that made them (a driver reads the arrays), so
    this is a plain container rather than a wire struct.

    Descriptors a ``Plan`` expanded are sealed: their arrays are read-only and
    ``origin`` names the (source, destination) manifest pair they lie inside
    by construction, so a backend that registered that source manifest,
    writing to a peer that advertised that destination manifest, need not scan
    their bounds again (on a heterogeneous NHD request the scan costs several
    times the expansion). Replacing or unlocking an array breaks the seal.
    """

    __slots__ = ("_seal", "dst", "nbytes", "src")

    def __init__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        self.src, self.dst, self.nbytes = src, dst, nbytes
        self._seal: tuple[Manifest, Manifest, tuple[np.ndarray, ...]] | None = None

    @property
    def origin(self) -> tuple[Manifest, Manifest] | None:
        """The manifest pair a plan expanded these for, while they are as it made them."""
        if self._seal is None:
            return None
        src, dst, arrays = self._seal
        current = (self.src, self.dst, self.nbytes)
        if any(a is not b or a.flags.writeable for a, b in zip(current, arrays, strict=True)):
            return None
        return src, dst

    def _sealed(self, src: Manifest, dst: Manifest) -> Descriptors:
        """Read-only views over read-only arrays, bound to the manifests they lie in."""
        views = []
        for a in (self.src, self.dst, self.nbytes):
            root = a  # expand's arrays are its own temporaries: lock their memory's owner
            while isinstance(root.base, np.ndarray):
                root = root.base
            root.setflags(write=False)
            view = a.view()
            view.setflags(write=False)
            views.append(view)
        out = Descriptors(*views)
        out._seal = (src, dst, tuple(views))
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Descriptors):
            return NotImplemented
        return all(
            np.array_equal(a, b)
            for a, b in ((self.src, other.src), (self.dst, other.dst), (self.nbytes, other.nbytes))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Descriptors({len(self)} copies, {self.total_bytes} bytes)"

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def empty(cls) -> Descriptors:
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )
