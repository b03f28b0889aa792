"""Staging sized past what the machine holds: the Session is refused with an XferError naming
``staging_bytes``, and the backend it was handed is left as it was (nothing registered);
before, numpy's ValueError or MemoryError came out of ``Session()``. And a request whose
pieces are more than the whole staging still ends DONE."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xferkit as xk
from xferkit.session import Session, State
from xferkit.testing import Reference, gdn_hybrid


@pytest.mark.parametrize("nbytes", [2**45, 2**70], ids=["32-TiB", "2**70"])
def test_staging_larger_than_memory_is_an_xfer_error_naming_it(nbytes: int) -> None:
    buf = np.zeros((8, 16), np.uint8)
    manifest = xk.Manifest.build([xk.Region.from_array(buf, pool="p", name="a", layer=0)])
    with xk.open_backend("loopback") as backend:
        try:
            with pytest.raises(xk.XferError, match="staging_bytes"):
                Session(backend, manifest, staging_bytes=nbytes, staging_slice_bytes=1 << 20)
        finally:
            assert backend.manifest is None  # refused before anything was registered


def test_a_request_whose_pieces_exceed_the_whole_staging_shrinks_them_and_ends_done() -> None:
    """Four sources into one decode rank, each offered a piece sized to the request (up to a
    slice), four pieces more than the decode rank's whole staging: the request waited for
    them until its deadline with nothing else in flight (found by the simulator's invariant
    8: TP 4 -> 1, no faults, FAILED at request_timeout_s). Now the pieces shrink to fit
    together (more rounds), and it is DONE, byte for byte."""
    slots = {"kv": 64, "state": 8}
    ref = Reference(gdn_hybrid(4), src_tp=4, dst_tp=1, src_slots=slots, dst_slots=slots)
    small: dict[str, Any] = {
        "staging": "always",
        "staging_bytes": 64 << 10,
        "staging_slice_bytes": 32 << 10,
    }
    pres = [Session(xk.open_backend("loopback"), r.manifest, **small) for r in ref.srcs]
    dec = Session(
        xk.open_backend("loopback"), ref.dsts[0].manifest, request_timeout_s=30.0, **small
    )
    try:
        dst = {"kv": list(range(40, 64)), "state": [5]}
        recv = dec.expect("big", [p.address for p in pres], dst)
        for p in pres:
            p.offer("big").write({"kv": list(range(24)), "state": [2]}, last=True)
        assert recv.wait(10) is State.DONE, recv.error  # before: still WAITING, until 30 s
        ref.check(0, {"kv": (list(range(24)), dst["kv"]), "state": ([2], dst["state"])})
    finally:
        for s in (*pres, dec):
            s.close()
