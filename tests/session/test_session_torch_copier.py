"""A staged Session pair whose copies run through the torch copier (on host memory, loopback).

A GPU rank stages through ``TorchCopier("cuda:N")``; forcing the same copier
on host memory runs every pack and unpack of a heterogeneous-TP request
through its code here, against the reference's bytes. Needs the torch extra.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from test_session_staged import Ranks

from xferkit import Manifest
from xferkit.session import State
from xferkit.session import session as session_module
from xferkit.torchcopier import TorchCopier


class Counting(TorchCopier):
    """The torch copier, counting the pieces it copied (so a test knows it ran)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.pieces = 0

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        super().copy(src, dst, nbytes)
        self.pieces += len(nbytes)


@pytest.fixture(params=[(4, 8), (8, 4)], ids=["tp4to8", "tp8to4"])
def ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ranks]:
    def torch_copier(manifest: Manifest) -> TorchCopier:
        return Counting()

    monkeypatch.setattr(session_module, "copier_of", torch_copier)
    r = Ranks(*request.param, staging="auto", staging_bytes=1 << 15, staging_slice_bytes=1 << 13)
    yield r
    r.close()


def test_a_heterogeneous_tp_request_stages_through_torch_and_lands_byte_exact(
    ranks: Ranks,
) -> None:
    src, dst = list(range(12)), [47 - 3 * i for i in range(12)]
    assert set(ranks.run("r", src, dst, chunks=3)) == {State.DONE}
    for i in range(len(ranks.dec)):
        ranks.ref.check(i, {"kv": (src, dst)})
    routes = ranks.paths()
    assert routes and routes <= {"pack", "unpack", "both"}, routes
    copiers = [s._copier for s in ranks.pre + ranks.dec]
    assert all(isinstance(c, Counting) for c in copiers)
    packed = sum(c.pieces for c in copiers[: len(ranks.pre)])  # type: ignore[attr-defined]
    unpacked = sum(c.pieces for c in copiers[len(ranks.pre) :])  # type: ignore[attr-defined]
    assert packed > 0 if routes & {"pack", "both"} else packed == 0
    assert unpacked > 0 if routes & {"unpack", "both"} else unpacked == 0
    assert ranks.staging_back()
