"""Every real driver between hosts: a prefill instance on one host, decode on another.

Each rank is a Session in its own process (``tests/session/session_rank.py``), started
inside its host (``xferkit.testing.hosts``), bound to its host's address, with the
driver told that address. The request is byte-exact on the decode rank, and the
decode host's link counted at least the payload: the bytes crossed the veth, not a
shortcut inside the kernel. The loopback is refused, saying why.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from xferkit.testing import requested_bytes
from xferkit.testing.hosts import Host, Hosts

sys.path.insert(0, str(Path(__file__).parents[1] / "session"))  # session_rank, as there
from session_rank import (
    Check,
    Expect,
    Offer,
    RankProcess,
    Setup,
    Wait,
    Write,
    reference,
)

TOPOLOGIES = [(2, 1), (1, 2)]  # (prefill TP, decode TP): heterogeneous both ways
LAYERS = 16
SLOTS = {"kv": 64, "state": 8}
SOURCE = {"kv": list(range(64)), "state": [0, 1, 2, 3]}
DEST = {"kv": list(range(63, -1, -1)), "state": [7, 6, 5, 4]}
FAST = {"heartbeat_s": 0.5, "handshake_timeout_s": 10.0, "request_timeout_s": 30.0}


def _options(driver: str, host: Host) -> dict[str, Any]:
    """What each driver needs to advertise its host's address rather than 127.0.0.1."""
    if driver == "mooncake":
        return {"protocol": "tcp", "hostname": host.address}
    return {}


def _env(driver: str) -> dict[str, str] | None:
    """NIXL: UCX over TCP on the host's interface. Left to itself, UCX sees the peer as
    intra-node (same kernel) and writes with CMA (process_vm_writev) across the network
    namespaces: the request is DONE and byte-exact, and 17 KB of 1 MB cross the link."""
    if driver == "nixl":
        return {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    return None


class _Ranks:
    def __init__(self, box: Hosts, driver: str, src_tp: int, dst_tp: int) -> None:
        pre, dec = box[0], box[1]
        tps = (src_tp, dst_tp)
        self.pre = [self._rank(pre, driver, "src", i, tps) for i in range(src_tp)]
        self.dec = [self._rank(dec, driver, "dst", i, tps) for i in range(dst_tp)]
        for r in self.pre + self.dec:  # set up in parallel, answered in turn
            reply = r.reply()
            assert reply.ok, reply.error
            r.address = reply.address

    @staticmethod
    def _rank(host: Host, driver: str, role: str, index: int, tps: tuple[int, int]) -> RankProcess:
        rank = RankProcess(host.prefix(), env=_env(driver))
        bind = f"tcp://{host.address}:0"
        options = _options(driver, host)
        setup = Setup(role, index, *tps, driver, options, session=FAST, bind=bind, layers=LAYERS)
        rank.send(msgspec.structs.replace(setup, slots=SLOTS))
        return rank

    def close(self) -> None:
        for r in self.pre + self.dec:
            r.close()


@pytest.fixture
def box() -> Iterator[Hosts]:
    with Hosts(2) as made:
        yield made


@pytest.mark.parametrize("driver", ["mooncake", "nixl"])
@pytest.mark.parametrize("tps", TOPOLOGIES, ids=lambda t: f"tp{t[0]}to{t[1]}")
def test_a_request_crosses_hosts_byte_exact_and_over_the_link(
    box: Hosts, driver: str, tps: tuple[int, int]
) -> None:
    ranks = _Ranks(box, driver, *tps)
    try:
        request = {pool: (SOURCE[pool], DEST[pool]) for pool in SOURCE}
        ref = reference(*tps, 0, LAYERS, SLOTS)
        payload = sum(requested_bytes(ref, d, request) for d in range(tps[1]))
        before = box[1].counters()
        sources = [p.address for p in ranks.pre]
        assert all(a.startswith("tcp://10.77.0.1:") for a in sources), sources
        for d in ranks.dec:
            d.ok(Expect("across", sources, DEST))
        for p in ranks.pre:
            p.ok(Offer("across"))
            p.ok(Write("across", SOURCE, last=True))
        for r in ranks.pre + ranks.dec:
            reply = r.ok(Wait("across", timeout=60))
            assert reply.state == "DONE", reply.error
        for d in ranks.dec:
            d.ok(Check(request))
        after = box[1].counters()
        crossed = after.rx_bytes - before.rx_bytes
        print(f"{driver} {tps}: payload {payload} B, decode host received {crossed} B")
        assert payload > 1 << 20 and crossed >= payload
    finally:
        ranks.close()


def test_the_loopback_between_hosts_fails_the_request_saying_why(box: Hosts) -> None:
    """The handshake's connect is refused (one host only): FAILED with that cause, not a
    payload written and a notification lost."""
    ranks = _Ranks(box, "loopback", 1, 1)
    try:
        (pre,), (dec,) = ranks.pre, ranks.dec
        dec.ok(Expect("refused", [pre.address], {"kv": [0], "state": [0]}))
        pre.ok(Offer("refused"))
        pre.ok(Write("refused", {"kv": [0], "state": [0]}, last=True))
        reply = dec.ok(Wait("refused", timeout=30))
        assert reply.state == "FAILED"
        assert "the loopback reaches processes on one host only" in reply.error, reply.error
    finally:
        ranks.close()
