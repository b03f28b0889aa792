"""Two backends, one connected to the other: the set-up most backend tests start from.

``connected_pair`` owns both backends: they close on the way out, the
receiver even when the sender's ``close()`` raises (the first error is the
one reported, a later one attached to it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..backend import Backend, Peer
from ..errors import XferError
from ..manifest import Manifest
from .memory import manifest_of


@dataclass
class Pair:
    """``a`` writes from its ``srcs`` into ``b``'s ``dsts`` through ``peer``."""

    a: Backend
    b: Backend
    srcs: list[np.ndarray]
    dsts: list[np.ndarray]
    peer: Peer
    endpoint: bytes
    """``b``'s endpoint as ``a`` connected to it."""

    @property
    def src(self) -> np.ndarray:
        return self.srcs[0]

    @property
    def dst(self) -> np.ndarray:
        return self.dsts[0]

    @property
    def manifest(self) -> Manifest:
        """What ``b`` registered (and ``a`` connected with)."""
        return self.peer.manifest


def close_all(*backends: Backend) -> None:
    """Close every backend, in order, even when one raises; raise the first error."""
    first: BaseException | None = None
    for backend in backends:
        try:
            backend.close()
        except BaseException as exc:
            if first is None:
                first = exc
            elif isinstance(first, XferError):
                first.attach(exc)
    if first is not None:
        raise first


@contextlib.contextmanager
def connected_pair(
    sender: Callable[[], Backend],
    srcs: Sequence[np.ndarray],
    dsts: Sequence[np.ndarray],
    *,
    receiver: Callable[[], Backend] | None = None,
    src_name: str = "src",
    dst_name: str = "dst",
    pool: str = "p",
) -> Iterator[Pair]:
    """Open ``sender()`` and ``receiver()`` (default: ``sender`` again), register ``srcs``
    and ``dsts`` (one region per array, pools ``{pool}0``...), connect; close both on exit."""
    opened: list[Backend] = []
    try:
        a = sender()
        opened.append(a)
        b = (receiver or sender)()
        opened.append(b)
        a.register(manifest_of(list(srcs), src_name, pool=pool))
        dst_manifest = manifest_of(list(dsts), dst_name, pool=pool)
        b.register(dst_manifest)
        endpoint = b.endpoint()
        peer = a.connect(endpoint, dst_manifest)
        yield Pair(a, b, list(srcs), list(dsts), peer, endpoint)
    finally:
        close_all(*opened)
