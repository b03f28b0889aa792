"""Careless and hostile use of a backend (issue 9): each case was a silent wrong write or a hang.

The mock driver makes every fault deterministic; the loopback's own versions
live in plugins/loopback/tests/test_loopback_hardening.py.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from mock_pairs import WAIT_S, descs, manifest, mock_pair, posted

import xferkit as xk
from xferkit import ArgumentError, Backend, BoundsError, Status, TransferError, XferError
from xferkit.testing import Reference, RegionSpec
from xferkit.testing.mock import STALL, Call, MockDriver


def stall(call: Call) -> str | None:
    """Every post stays PENDING until released."""
    return STALL if call.op == "post" else None


class Stuck(MockDriver):
    """A driver that ignores release(): its batches never end until the test says so."""

    def post(self, link: Any, d: xk.Descriptors, notify: bytes | None) -> xk.driver.Posted:
        posted_batch = super().post(link, d, notify)
        posted_batch.release = lambda: None  # type: ignore[method-assign]
        return posted_batch


def test_a_negative_max_batch_is_refused_when_the_backend_opens() -> None:
    """Before: max_batch=-1 made every write an empty split that ended DONE, moving nothing."""
    with pytest.raises(xk.OptionError, match="max_batch"):
        Backend(MockDriver(max_batch=-1))
    with pytest.raises(xk.OptionError, match="max_batch"):
        xk.open_backend("loopback", max_batch=-1)


def test_an_unlocked_seal_cannot_be_forged() -> None:
    """Before: unlocking the root array behind ``descs.src.base`` kept the seal (no bounds scan)."""
    spec = RegionSpec(pool="kv", name="k", layer=0, shape=(4, 8), tp_axis=0)
    ref = Reference([spec], src_tp=1, dst_tp=1, src_slots={"kv": 8}, dst_slots={"kv": 8})
    with Backend(MockDriver()) as a, Backend(MockDriver()) as b:
        a.register(ref.srcs[0].manifest)
        b.register(ref.dsts[0].manifest)
        peer = a.connect(b.endpoint(), ref.dsts[0].manifest)
        d = xk.plan(ref.srcs[0].manifest, ref.dsts[0].manifest).expand({"kv": ([1], [2])})
        assert d.origin is not None
        for array in (d.src, d.dst, d.nbytes):
            root: Any = array
            while getattr(root, "base", None) is not None and isinstance(root.base, np.ndarray):
                root = root.base
            with pytest.raises(ValueError):
                root.setflags(write=True)
            assert isinstance(root.base, bytes)  # immutable memory at the bottom
            with pytest.raises(ValueError):
                np.frombuffer(root.base, dtype=np.uint64)[0] = 1 << 40
            with pytest.raises(ValueError):
                array[0] = 1 << 40
        # Swapping an attribute keeps the bytes honest: the seal goes, the scan refuses.
        d.src = np.array([1 << 40], dtype=np.uint64)
        assert d.origin is None
        with pytest.raises(BoundsError):
            a.write(peer, d)
        assert posted(a) == []


@pytest.mark.parametrize("note", ["done", 7, [b"x"], bytearray(b"x")])
def test_a_notification_must_be_bytes(note: Any) -> None:
    """Before: a str notification ended DONE and then made the receiver raise."""
    with mock_pair() as p:
        d, _ = p.descs(1, 16)
        with pytest.raises(ArgumentError, match="bytes"):
            p.a.write(p.peer, d, notify=note)
        assert posted(p.a) == []


def test_a_write_past_its_deadline_fails_and_is_aborted() -> None:

    with mock_pair(stall) as p:
        d, _ = p.descs(2, 16)
        t = p.a.write(p.peer, d, timeout=0.05)
        with pytest.raises(TransferError, match="timed out"):
            t.wait(WAIT_S)
        assert t.poll() is Status.FAILED
        assert all(h.released for h in p.driver.handles)


@pytest.mark.parametrize("timeout", [-1, "5", True, float("nan")])
def test_a_bad_write_deadline_is_refused(timeout: Any) -> None:
    with mock_pair() as p:
        d, _ = p.descs(1, 16)
        with pytest.raises(XferError, match="timeout"):
            p.a.write(p.peer, d, timeout=timeout)
        assert posted(p.a) == []


def test_close_ends_split_writes_instead_of_stranding_them() -> None:
    """Before: the last batch went to a stopped worker; wait() without a timeout never returned."""
    held: list[Call] = []

    def slow_first(call: Call) -> str | None:
        if call.op == "post" and call.count == 1:
            held.append(call)
            return STALL
        return None

    with mock_pair(slow_first, max_batch=2) as p:
        d, _ = p.descs(6, 16)
        t = p.a.write(p.peer, d)
        p.a.close()
        started = time.monotonic()
        with pytest.raises(TransferError, match="closed"):
            t.wait()  # no timeout: it must end by itself
        assert time.monotonic() - started < WAIT_S
        ops = [c.op for c in p.driver.calls]
        # Nothing posted after close; disconnect and deregister came after the abort.
        assert ops.index("disconnect") > max(i for i, op in enumerate(ops) if op == "post")


def test_deregister_with_transfers_in_flight_ends_them_first() -> None:
    """One behaviour for every driver: deregister aborts and drains, then releases memory."""

    with mock_pair(stall) as p:
        d, _ = p.descs(2, 16)
        t = p.a.write(p.peer, d)
        p.a.deregister()
        assert t.poll() is Status.FAILED
        assert t.error is not None and "deregistered" in str(t.error)
        ops = [c.op for c in p.driver.calls]
        assert ops.index("deregister") > ops.index("post")
        assert all(h.released for h in p.driver.handles)


def test_after_close_the_error_says_closed_not_unregistered() -> None:
    """Before: a queued write reported "local address ... is not registered" after close()."""

    with mock_pair(stall) as p:
        d, _ = p.descs(1, 16)
        t = p.a.write(p.peer, d)
        p.a.close()
        assert t.error is not None
        assert "closed" in str(t.error) and "not registered" not in str(t.error)


def test_a_driver_that_never_lets_go_makes_abort_raise_not_hang() -> None:
    """Nothing waits without a deadline: a batch the driver keeps running is reported."""

    with Backend(Stuck(stall)) as a, Backend(MockDriver()) as b:
        src, dst = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
        a.register(manifest([src], "s"))
        b.register(manifest([dst], "d"))
        peer = a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        t = a.write(peer, descs([src.ctypes.data], [dst.ctypes.data], [8]))
        with pytest.raises(TransferError, match="still running"):
            t.abort(timeout=0.05)
        assert t.poll() is Status.PENDING  # not terminal: the driver may still write
        a.driver.handles[0]._status = Status.FAILED  # type: ignore[attr-defined]
        assert t.poll() is Status.FAILED


def test_deregister_keeps_memory_registered_while_a_driver_still_runs_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Releasing memory under a running batch would let the engine touch freed memory."""
    import xferkit.backend as core

    monkeypatch.setattr(core, "DRAIN_S", 0.05)

    with Backend(MockDriver()) as b:
        a = Backend(Stuck(stall))
        src, dst = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
        a.register(manifest([src], "s"))
        b.register(manifest([dst], "d"))
        peer = a.connect(b.endpoint(), b.manifest)  # type: ignore[arg-type]
        t = a.write(peer, descs([src.ctypes.data], [dst.ctypes.data], [8]))
        with pytest.raises(TransferError, match="still running"):
            a.deregister()
        assert a.manifest is not None
        assert not [c for c in a.driver.calls if c.op == "deregister"]  # type: ignore[attr-defined]
        a.driver.handles[0]._status = Status.FAILED  # type: ignore[attr-defined]
        a.deregister()  # the batch ended: now it goes
        assert a.manifest is None and t.poll() is Status.FAILED
        a.close()
