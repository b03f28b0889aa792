"""Mooncake-specific behaviour beyond the conformance kit, on the real engine over TCP."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

import xferkit as xk
from xferkit.testing.conformance import DST_SLOTS, REQUEST, SRC_SLOTS, gdn_hybrid_specs
from xferkit.testing.reference import Reference
from xferkit_mooncake import engine as mc_engine

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}


def _open(**extra) -> xk.Backend:
    return xk.open_backend("mooncake", **{**OPTIONS, **extra})


def _region(array: np.ndarray, name: str) -> xk.Region:
    return xk.Region.from_array(array, pool=name, name=name, layer=0)


class _EngineSpy:
    """The real engine, with the registration calls it receives written down."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.sizes: list[int] = []

    def batch_register_memory(self, addrs, sizes, *args):
        self.sizes += sizes
        return self._engine.batch_register_memory(addrs, sizes, *args)

    def register_memory(self, addr, size, *args):
        self.sizes.append(size)
        return self._engine.register_memory(addr, size, *args)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def pair():
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    a, b = _open(), _open()
    a.register(xk.Manifest.build([_region(src, "src")]))
    b.register(xk.Manifest.build([_region(dst, "dst")]))
    peer = a.connect(b.endpoint(), b.manifest)
    yield a, b, peer, src, dst
    a.close()
    b.close()


def _blocks(src: np.ndarray, dst: np.ndarray, n: int, size: int) -> xk.Descriptors:
    order = np.random.default_rng(n).permutation(n).astype(np.uint64)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return xk.Descriptors(
        np.uint64(src.ctypes.data) + offs,
        np.uint64(dst.ctypes.data) + order * np.uint64(size),
        np.full(n, size, dtype=np.uint64),
    )


def _expect(src: np.ndarray, dst: np.ndarray, d: xk.Descriptors) -> None:
    for s, t, n in zip(d.src.tolist(), d.dst.tolist(), d.nbytes.tolist(), strict=True):
        so, to = s - src.ctypes.data, t - dst.ctypes.data
        assert np.array_equal(dst[to : to + n], src[so : so + n])


def test_empty_state_entries_register_and_transfer_cleanly() -> None:
    """GDN hybrid with empty short-conv entries: Mooncake never sees a zero-length region."""
    ref = Reference(
        gdn_hybrid_specs(), src_tp=1, dst_tp=1, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
    )
    src_rank, dst_rank = ref.srcs[0], ref.dsts[0]
    assert src_rank.manifest.dropped and dst_rank.manifest.dropped  # the sconv entries
    with _open() as a, _open() as b:
        spies = [_EngineSpy(x._engine) for x in (a, b)]
        a._engine, b._engine = spies
        a.register(src_rank.manifest)
        b.register(dst_rank.manifest)
        for spy, m in zip(spies, (src_rank.manifest, dst_rank.manifest), strict=True):
            assert spy.sizes == [r.nbytes for r in m.regions] and min(spy.sizes) > 0
        peer = a.connect(b.endpoint(), dst_rank.manifest)
        descs = xk.plan(src_rank.manifest, dst_rank.manifest).expand(REQUEST)
        a.write(peer, descs, notify=b"req").wait(30)
        ref.check(0, REQUEST)
        assert [n.message for n in _drain(b, 1)] == [b"req"]


def _drain(backend: xk.Backend, count: int, timeout: float = 10) -> list[xk.Notification]:
    notes: list[xk.Notification] = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        notes += backend.notifications()
        time.sleep(0.001)
    return notes


def test_binary_notifications_roundtrip(pair) -> None:
    a, b, peer, _, _ = pair
    payloads = [b"\x00\xff", bytes(range(256)), b"", "é€".encode(), bytes(64 << 10)]
    for p in payloads:
        a.write(peer, xk.Descriptors.empty(), notify=p).wait(10)
    notes = _drain(b, len(payloads))
    assert [n.message for n in notes] == payloads
    assert {n.peer for n in notes} == {a.peer_name}


def test_large_writes_split_under_the_engine_limit_with_the_notification_last(pair) -> None:
    a, b, peer, src, dst = pair
    assert a.capabilities.max_batch == 1024
    d = _blocks(src, dst, 3000, 512)  # three engine batches; raw, 3000 entries would fail
    a.write(peer, d, notify=b"last").wait(30)
    _expect(src, dst, d)
    assert [n.message for n in _drain(b, 1)] == [b"last"]


def test_poll_never_blocks(pair) -> None:
    a, _, peer, src, dst = pair
    d = _blocks(src, dst, 2048, 4096)  # two engine batches, a few hundred ms over tcp
    began = time.perf_counter()
    t = a.write(peer, d)
    times: list[float] = []
    while True:
        start = time.perf_counter()
        st = t.poll()
        times.append(time.perf_counter() - start)
        if st is not xk.Status.PENDING:
            break
        time.sleep(0.001)
    elapsed = time.perf_counter() - began
    assert st is xk.Status.DONE
    # poll() came back again and again while the data moved, typically in a tiny fraction
    # of the transfer. The median, relative to the transfer, so that one scheduler or GC
    # hiccup on a loaded machine cannot decide it.
    typical = sorted(times)[len(times) // 2]
    assert len(times) > 3 and typical < elapsed / 20, (len(times), typical, elapsed)
    _expect(src, dst, d)


def test_same_peer_recovers_after_refusing_a_write(pair) -> None:
    """No blacklist, in our layer or the engine's: even after a full 1024-entry batch."""
    a, b, peer, src, dst = pair
    a.write(peer, _blocks(src, dst, 1024, 256)).wait(30)
    m = b.manifest
    b.deregister()  # the peer stops accepting writes into that memory
    d = _blocks(src, dst, 4, 4096)
    with pytest.raises(xk.TransferError) as info:
        a.write(peer, d).wait(30)
    text = str(info.value)
    assert peer.handle.segment in text and "-1" in text and "refused the write" in text
    b.register(m)
    dst[:] = 0
    a.write(peer, d).wait(30)  # same peer, same segment: works again
    _expect(src, dst, d)


def test_dead_peer_then_a_new_one(pair) -> None:
    a, b, peer, src, dst = pair
    m = b.manifest
    b.close()
    d = _blocks(src, dst, 8, 4096)
    with pytest.raises(xk.TransferError) as info:
        a.write(peer, d).wait(30)
    assert peer.handle.segment in str(info.value) and "ERR_SOCKET" in str(info.value)
    with _open() as b2:
        b2.register(m)
        a.write(a.connect(b2.endpoint(), m), d).wait(30)
    _expect(src, dst, d)


def test_registration_failure_names_the_region_and_the_engine_code() -> None:
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    m = xk.Manifest.build([_region(x, f"r{i}") for i, x in enumerate(bufs)])
    with _open() as a:
        assert a._engine.register_memory(bufs[2].ctypes.data, 4096) == 0  # behind the core
        with pytest.raises(xk.RegistrationError) as info:
            a.register(m)
        text = str(info.value)
        assert "r2" in text and "entry #3" in text and "ERR_ADDRESS_OVERLAPPED" in text
        assert "overlapped memory region" in text  # Mooncake's own words
        assert a._engine.unregister_memory(bufs[2].ctypes.data) == 0
        a.register(m)  # the first two were rolled back
        assert a.manifest is m


def test_protocol_mismatch_is_refused_at_connect() -> None:
    with _open() as a, _open() as b:
        blob = b._endpoint()
        b.protocol = "rdma"  # what an rdma peer would advertise
        with pytest.raises(xk.ProtocolError, match="rdma"):
            a.connect(b.endpoint(), xk.Manifest.build([]))
        b.protocol = "tcp"
        assert b._endpoint() == blob


def test_options_are_checked() -> None:
    with pytest.raises(xk.CapabilityError, match="max_batch"):
        _open(max_batch=4096)
    with pytest.raises(xk.CapabilityError, match="protocol"):
        _open(protocol="carrier-pigeon")
    with _open(notifications=False) as a:
        assert not a.capabilities.notifications


def test_default_protocol_follows_rdma_devices(tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="xferkit.mooncake")
    monkeypatch.setattr(mc_engine, "INFINIBAND", str(tmp_path / "absent"))
    assert mc_engine.pick_protocol(None) == "tcp"
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(mc_engine, "INFINIBAND", str(tmp_path))
    assert mc_engine.pick_protocol(None) == "rdma"
    assert "protocol tcp (no RDMA device" in caplog.text
    assert "protocol rdma (RDMA devices" in caplog.text and "mlx5_0" in caplog.text


def test_close_finds_the_handshake_listener() -> None:
    """The fast teardown (see engine.stop) must find the socket it shortens."""
    with _open() as a:
        port = int(a.segment.rsplit(":", 1)[1])
        sock = mc_engine._listening_socket(port)
        assert sock is not None
        sock.close()
