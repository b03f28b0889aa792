"""A decode rank whose memory was re-registered under its Session is never written through
the stale endpoint (issue 9, item 4): the prefill side compares registration generations.

NIXL is the driver that needs it: UCX on one host does not enforce remote
deregistration, so a bare ``Backend`` writing through the old endpoint lands
(the kit's strict xfail). Through the Session the write is refused first.
"""

from __future__ import annotations

import numpy as np
import pytest

import xferkit as xk
from xferkit.session import RequestError, Session, State
from xferkit.testing.conformance import require_backend

require_backend("nixl")


def _session(buf: np.ndarray) -> Session:
    region = xk.Region.from_array(buf.reshape(8, -1), pool="kv", name="k", layer=0)
    manifest = xk.Manifest.build([region])
    return Session(xk.open_backend("nixl"), manifest, heartbeat_s=0.2, dead_after_s=5.0)


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_stale_registration_is_refused_before_anything_is_written(first: str) -> None:
    src = np.arange(8 * 4096, dtype=np.uint32).view(np.uint8)[: 8 * 4096].copy()
    dst = np.zeros(8 * 4096, dtype=np.uint8)
    pre, dec = _session(src), _session(dst)
    try:
        recv = dec.expect("r1", [pre.address], {"kv": [1]})
        pre.offer("r1").write({"kv": [2]}, last=True)
        assert recv.wait(10) is State.DONE
        assert (dst.reshape(8, -1)[1] == src.reshape(8, -1)[2]).all()

        manifest = dec.backend.manifest
        assert manifest is not None
        dec.backend.deregister()  # an engine re-registers underneath its Session
        dec.backend.register(manifest)
        dst[:] = 0
        if first == "prefill":  # the prefill side holds its slots before the decode asks
            send = pre.offer("r2")
            send.write({"kv": [4]}, last=True)
            recv = dec.expect("r2", [pre.address], {"kv": [3]})
        else:
            recv = dec.expect("r2", [pre.address], {"kv": [3]})
            send = pre.offer("r2")
            send.write({"kv": [4]}, last=True)
        for handle in (recv, send):
            with pytest.raises(RequestError, match="re-registered"):
                handle.wait(10)
        assert not dst.any()  # nothing landed through the stale endpoint
    finally:
        pre.close()
        dec.close()
