"""A heterogeneous-TP handoff (GDN hybrid, prefill TP 2 -> decode TP 4) through Mooncake,
every rank in its own process, byte-exact against the reference model.

The conformance kit's cross-process tests put one side in this process; here
no rank shares a process with another, as in a real deployment.
"""

from __future__ import annotations

import contextlib
import time

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

from xferkit import Manifest, coverage
from xferkit.testing.conformance import DST_SLOTS, REQUEST, SRC_SLOTS, gdn_hybrid_specs
from xferkit.testing.peer import Check, Drain, PeerProcess, Setup, Write

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}
SRC_TP, DST_TP = 2, 4


def _setup(role: str, index: int) -> Setup:
    return Setup(
        backend="mooncake",
        options=OPTIONS,
        specs=gdn_hybrid_specs(),
        src_tp=SRC_TP,
        dst_tp=DST_TP,
        src_slots=SRC_SLOTS,
        dst_slots=DST_SLOTS,
        role=role,
        index=index,
    )


def test_gdn_hybrid_tp2_to_tp4_across_processes() -> None:
    with contextlib.ExitStack() as stack:
        # Start all six processes first: they boot in parallel.
        srcs = [stack.enter_context(PeerProcess()) for _ in range(SRC_TP)]
        dsts = [stack.enter_context(PeerProcess()) for _ in range(DST_TP)]
        src_ready = [p.ask(_setup("src", i)) for i, p in enumerate(srcs)]
        dst_ready = [p.ask(_setup("dst", j)) for j, p in enumerate(dsts)]
        assert all(r.ok for r in src_ready + dst_ready), [r.error for r in src_ready + dst_ready]
        src_manifests = [Manifest.decode(r.manifest) for r in src_ready]
        assert all(m.dropped for m in src_manifests)  # the empty short-conv entries
        expected: dict[int, list[bytes]] = {}
        for j, ready in enumerate(dst_ready):
            sources = coverage(src_manifests, Manifest.decode(ready.manifest)).sources
            assert sources  # every decode rank is fed by at least one prefill rank
            expected[j] = sorted(f"prefill {s} -> decode {j}".encode() for s in sources)
            for s in sources:
                reply = srcs[s].ask(
                    Write(
                        endpoint=ready.endpoint,
                        manifest=ready.manifest,
                        slots=REQUEST,
                        notify=f"prefill {s} -> decode {j}".encode(),
                    )
                )
                assert reply.ok, reply.error
        for j, proc in enumerate(dsts):
            result = proc.ask(Check(slots=REQUEST))
            assert result.ok, f"decode rank {j}: {result.error}"
            notes: list = []
            deadline = time.monotonic() + 10
            while len(notes) < len(expected[j]) and time.monotonic() < deadline:
                notes += proc.ask(Drain()).notes
            assert sorted(m for _, m in notes) == expected[j]
