"""The loopback reaches processes on one host only, and says so at connect.

Before: a prefill rank in one network namespace writing to a decode rank in
another wrote the whole payload (8,164 of 8,192 bytes changed) and then failed
on the notification: "data written, but the notification to ... failed:
[Errno 111] Connection refused".
"""

from __future__ import annotations

import numpy as np
import pytest

import xferkit as xk
from xferkit.testing.crossprocess import peer_memory
from xferkit.testing.hosts import Hosts
from xferkit.testing.peer import Fill, PeerProcess, Setup, Write
from xferkit.testing.reference import RegionSpec

SENTINEL = 0x5A
SPEC = RegionSpec(pool="raw", name="buf", layer=0, shape=(4096,), itemsize=1)


def _setup(role: str) -> Setup:
    slots = {"raw": 2}
    return Setup("loopback", {}, [SPEC], 1, 1, slots, slots, role=role, index=0)


def test_a_peer_on_another_host_is_refused_at_connect_and_nothing_lands() -> None:
    with Hosts(2) as box, PeerProcess(box[0].prefix()) as src, PeerProcess(box[1].prefix()) as dst:
        assert src.ask(_setup("src")).ok
        ready = dst.ask(_setup("dst"))
        assert ready.ok, ready.error
        assert dst.ask(Fill(value=SENTINEL)).ok
        manifest = xk.Manifest.decode(ready.manifest)
        write = Write(ready.endpoint, ready.manifest, {"raw": ([0, 1], [0, 1])}, notify=b"done")
        reply = src.ask(write)
        assert not reply.ok
        assert reply.error.startswith("CapabilityError: the loopback reaches processes on one host")
        assert f"peer loopback:{dst.pid}:" in reply.error and "network namespace" in reply.error
        assert (peer_memory(dst.pid, manifest) == SENTINEL).all()  # not one byte landed


def test_a_peer_whose_notification_socket_is_gone_is_refused_at_connect() -> None:
    """Same host, but the peer's socket is not there (it closed): refused before writing."""
    src = np.full(4096, 7, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    regions = [xk.Region.from_array(dst, pool="p", name="buf", layer=0)]
    with xk.open_backend("loopback") as a:
        a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="buf", layer=0)]))
        b = xk.open_backend("loopback")
        b.register(xk.Manifest.build(regions))
        endpoint, manifest = b.endpoint(), b.manifest
        assert manifest is not None
        b.close()
        with pytest.raises(xk.TransferError, match="notification socket is unreachable") as err:
            a.connect(endpoint, manifest)
        assert "nothing was written" in str(err.value) and str(err.value.subject).startswith(
            "loopback:"
        )
    assert not dst.any()
