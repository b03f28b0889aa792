"""Mooncake-specific behaviour beyond the conformance kit, on the real engine over TCP."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mooncake_helpers import WAIT_S, EngineSpy, driver_of, open_mooncake

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

import xferkit as xk
from xferkit.driver import rdma_devices
from xferkit.testing.conformance import (
    DST_SLOTS,
    REQUEST,
    SRC_SLOTS,
    drain_until,
    gdn_hybrid_specs,
)
from xferkit.testing.reference import Reference
from xferkit_mooncake import engine as mc_engine
from xferkit_mooncake.lane import MAX_RUN, RUN, decode_messages, encode_messages

Pair = tuple[xk.Backend, xk.Backend, xk.Peer, np.ndarray, np.ndarray]


def _region(array: np.ndarray, name: str) -> xk.Region:
    return xk.Region.from_array(array, pool=name, name=name, layer=0)


@pytest.fixture
def pair() -> Iterator[Pair]:
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    a, b = open_mooncake(), open_mooncake()
    a.register(xk.Manifest.build([_region(src, "src")]))
    b.register(xk.Manifest.build([_region(dst, "dst")]))
    assert b.manifest is not None
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
    """``_blocks`` moved equal-sized blocks: compare them all at once."""
    size = int(d.nbytes[0])
    s = ((d.src - np.uint64(src.ctypes.data)) // np.uint64(size)).astype(np.int64)
    t = ((d.dst - np.uint64(dst.ctypes.data)) // np.uint64(size)).astype(np.int64)
    np.testing.assert_array_equal(dst.reshape(-1, size)[t], src.reshape(-1, size)[s])


def _lanes(segment: str, settle: float = 5) -> int:
    """Worker threads running towards ``segment``, once those told to stop have ended."""
    deadline = time.monotonic() + settle
    while True:
        lanes = [t for t in threading.enumerate() if t.name == f"xferkit-mooncake-{segment}"]
        if len(lanes) <= 1 or time.monotonic() >= deadline:
            return len(lanes)
        time.sleep(0.01)


def test_empty_state_entries_register_and_transfer_cleanly() -> None:
    """GDN hybrid with empty short-conv entries: Mooncake never sees a zero-length region."""
    ref = Reference(
        gdn_hybrid_specs(), src_tp=1, dst_tp=1, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
    )
    src_rank, dst_rank = ref.srcs[0], ref.dsts[0]
    assert src_rank.manifest.dropped and dst_rank.manifest.dropped  # the sconv entries
    with open_mooncake() as a, open_mooncake() as b:
        spies = []
        for x in (a, b):
            spy = EngineSpy(driver_of(x).engine)
            driver_of(x).engine = spy
            spies.append(spy)
        a.register(src_rank.manifest)
        b.register(dst_rank.manifest)
        for spy, m in zip(spies, (src_rank.manifest, dst_rank.manifest), strict=True):
            # Touching regions share one engine buffer; every byte is covered once.
            assert sum(spy.sizes) == sum(r.nbytes for r in m.regions) and min(spy.sizes) > 0
        peer = a.connect(b.endpoint(), dst_rank.manifest)
        descs = xk.plan(src_rank.manifest, dst_rank.manifest).expand(REQUEST)
        a.write(peer, descs, notify=b"req").wait(30)
        ref.check(0, REQUEST)
        assert [n.message for n in drain_until(b, 1, WAIT_S)] == [b"req"]


def test_binary_notifications_roundtrip(pair: Pair) -> None:
    a, b, peer, _, _ = pair
    payloads = [b"\x00\xff", bytes(range(256)), b"", "é€".encode(), bytes(64 << 10)]
    for p in payloads:
        a.write(peer, xk.Descriptors.empty(), notify=p).wait(10)
    notes = drain_until(b, len(payloads), WAIT_S)
    assert [n.message for n in notes] == payloads
    # The sender's segment, exactly as the receiver's Peer for it is named.
    assert {n.peer for n in notes} == {f"mooncake:{driver_of(a).address}"}
    assert a.manifest is not None
    assert b.connect(a.endpoint(), a.manifest).name == notes[0].peer


def test_a_notification_alone_needs_no_registered_memory() -> None:
    """The zero-length entry carrying it has anchors even when neither side registered any."""
    empty = xk.Manifest.build([])
    with open_mooncake() as a, open_mooncake() as b:
        a.register(empty)
        b.register(empty)
        a.write(a.connect(b.endpoint(), empty), xk.Descriptors.empty(), notify=b"hi").wait(10)
        assert [n.message for n in drain_until(b, 1, WAIT_S)] == [b"hi"]


def test_large_writes_split_under_the_engine_limit_with_the_notification_last(pair: Pair) -> None:
    a, b, peer, src, dst = pair
    assert a.capabilities.max_batch == 1024
    d = _blocks(src, dst, 3000, 512)  # three engine batches; raw, 3000 entries would fail
    a.write(peer, d, notify=b"last").wait(30)
    _expect(src, dst, d)
    assert [n.message for n in drain_until(b, 1, WAIT_S)] == [b"last"]


def test_poll_never_blocks(pair: Pair) -> None:
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


def test_one_lane_per_connection_stopped_with_its_last_peer(pair: Pair) -> None:
    a, b, peer, src, dst = pair
    segment = driver_of(b).address
    assert _lanes(segment) == 1
    assert b.manifest is not None
    again = a.connect(b.endpoint(), b.manifest)  # the core counts: the same connection
    assert _lanes(segment) == 1
    a.disconnect(peer)
    d = _blocks(src, dst, 4, 4096)
    a.write(again, d).wait(30)  # the lane still serves the other peer
    _expect(src, dst, d)
    a.disconnect(again)
    deadline = time.monotonic() + 5
    while _lanes(segment) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _lanes(segment) == 0


def _nice(tid: int) -> int:
    """A thread's nice value, as the kernel reports it (field 19 of its stat)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("lane_nice", [None, 0, 19])
def test_a_lane_spinning_in_the_engine_yields_a_busy_cpu(lane_nice: int | None) -> None:
    """The engine's synchronous call busy-waits while a batch is in flight; the lane that
    makes it runs at a lower priority than the rest of the process (5 by default)."""
    src = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    options = {} if lane_nice is None else {"lane_nice": lane_nice}
    with open_mooncake(**options) as a, open_mooncake() as b:
        a.register(xk.Manifest.build([_region(src, "src")]))
        b.register(xk.Manifest.build([_region(dst, "dst")]))
        assert b.manifest is not None
        peer = a.connect(b.endpoint(), b.manifest)
        d = _blocks(src, dst, 16, 4096)
        a.write(peer, d).wait(30)
        _expect(src, dst, d)
        segment = driver_of(b).address
        (lane,) = [t for t in threading.enumerate() if t.name == f"xferkit-mooncake-{segment}"]
        assert lane.native_id is not None
        mine = _nice(threading.get_native_id())
        want = 5 if lane_nice is None else lane_nice
        assert _nice(lane.native_id) == min(mine + want, 19)


def test_registering_again_gives_a_new_segment_and_lane(pair: Pair) -> None:
    """Re-registration after an endpoint was handed out retires the segment: a new endpoint,
    a new lane; the old peer is refused by the old segment (checked by Mooncake itself)."""
    a, b, old, src, dst = pair
    segment = driver_of(b).address
    b.deregister()
    moved = np.zeros_like(dst)
    m = xk.Manifest.build([_region(moved, "dst")])
    b.register(m)
    assert driver_of(b).address != segment
    peer = a.connect(b.endpoint(), m)
    d = _blocks(src, moved, 16, 4096)
    a.write(peer, d, notify=b"moved").wait(30)
    _expect(src, moved, d)
    assert [n.message for n in drain_until(b, 1, WAIT_S)] == [b"moved"]
    with pytest.raises(xk.TransferError, match="refused the write"):
        a.write(old, _blocks(src, dst, 4, 4096)).wait(30)
    assert not dst.any()
    assert _lanes(segment) == 1 and _lanes(driver_of(b).address) == 1


def test_same_peer_is_refused_after_deregistering_then_reached_again(pair: Pair) -> None:
    """No blacklist, in our layer or the engine's, even after a full 1024-entry batch: the
    peer's new endpoint is reached at once; the old one stays refused."""
    a, b, peer, src, dst = pair
    a.write(peer, _blocks(src, dst, 1024, 256)).wait(30)
    m = b.manifest
    assert m is not None
    b.deregister()  # the peer stops accepting writes into that memory
    d = _blocks(src, dst, 4, 4096)
    dst[:] = 0
    with pytest.raises(xk.TransferError) as info:
        a.write(peer, d).wait(30)
    text = str(info.value)
    assert driver_of(b).address in text and "-1" in text and "refused the write" in text
    b.register(m)
    with pytest.raises(xk.TransferError, match="refused the write"):
        a.write(peer, d).wait(30)  # the same memory again, but under a new segment
    assert not dst.any()
    a.write(a.connect(b.endpoint(), m), d).wait(30)
    _expect(src, dst, d)


def test_dead_peer_then_a_new_one(pair: Pair) -> None:
    a, b, peer, src, dst = pair
    m, segment = b.manifest, driver_of(b).address
    assert m is not None
    b.close()
    d = _blocks(src, dst, 8, 4096)
    with pytest.raises(xk.TransferError) as info:
        a.write(peer, d).wait(30)
    assert segment in str(info.value) and "ERR_SOCKET" in str(info.value)
    with open_mooncake() as b2:
        b2.register(m)
        a.write(a.connect(b2.endpoint(), m), d).wait(30)
    _expect(src, dst, d)


def test_registration_failure_names_the_region_and_the_engine_code() -> None:
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    m = xk.Manifest.build([_region(x, f"r{i}") for i, x in enumerate(bufs)])
    with open_mooncake() as a:
        engine = driver_of(a).engine
        assert engine.register_memory(bufs[2].ctypes.data, 4096) == 0  # behind the core
        with pytest.raises(xk.RegistrationError) as info:
            a.register(m)
        text = str(info.value)
        assert "r2" in text and "entry #3" in text and "ERR_ADDRESS_OVERLAPPED" in text
        assert "overlapped memory region" in text  # Mooncake's own words
        assert engine.unregister_memory(bufs[2].ctypes.data) == 0
        a.register(m)  # the first two were rolled back
        assert a.manifest is m


def test_protocol_mismatch_is_refused_at_connect() -> None:
    """A real rdma engine (it starts without a NIC) advertises its protocol; tcp refuses it."""
    empty = xk.Manifest.build([])
    with open_mooncake() as a, open_mooncake(protocol="rdma") as b:
        b.register(empty)
        with pytest.raises(xk.ProtocolError, match="speaks rdma"):
            a.connect(b.endpoint(), empty)


@pytest.mark.parametrize(
    "options",
    [
        {"max_batch": 4096},
        {"max_batch": 0},
        {"max_batch": True},
        {"protocol": "carrier-pigeon"},
        {"device": 0},
        {"hostname": ""},
        {"notifications": "yes"},
        {"lane_nice": 20},
        {"lane_nice": -1},
        {"lane_nice": 1.5},
    ],
)
def test_bad_options_are_option_errors(options: dict[str, Any]) -> None:
    with pytest.raises(xk.OptionError, match=next(iter(options))):
        open_mooncake(**options)


def test_notifications_can_be_declined() -> None:
    with open_mooncake(notifications=False) as a:
        assert not a.capabilities.notifications


def test_default_protocol_follows_rdma_devices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xferkit.mooncake")
    assert mc_engine.pick_protocol(None, rdma_devices(str(tmp_path / "absent"))) == "tcp"
    (tmp_path / "mlx5_0").mkdir()
    assert mc_engine.pick_protocol(None, rdma_devices(str(tmp_path))) == "rdma"
    assert mc_engine.pick_protocol("tcp", rdma_devices(str(tmp_path))) == "tcp"
    assert "protocol tcp (no RDMA device" in caplog.text
    assert "protocol rdma (RDMA devices" in caplog.text and "mlx5_0" in caplog.text


def test_close_finds_the_handshake_listener() -> None:
    """The fast teardown (see engine.stop) must find the socket it shortens."""
    with open_mooncake() as a:
        port = int(driver_of(a).address.rsplit(":", 1)[1])
        sock = mc_engine._listening_socket(port)
        assert sock is not None
        sock.close()


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=8))
def test_the_messages_of_a_run_come_back_one_by_one_as_sent(messages: list[bytes]) -> None:
    assert decode_messages(encode_messages(messages)) == messages


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=8), st.text(max_size=64))
def test_a_notification_not_framed_as_a_run_comes_whole(messages: list[bytes], text: str) -> None:
    """Another sender's text (UTF-8 past latin-1), a frame cut short or padded: one message
    as it came, never an exception or a message made up."""
    if not text.startswith(RUN.decode("latin-1")):
        try:
            assert decode_messages(text) == [text.encode("latin-1")]
        except UnicodeEncodeError:
            assert decode_messages(text) == [text.encode("utf-8")]
    framed = encode_messages([b"x", *messages])
    for broken in (framed[:-1], framed + "\x05"):
        assert decode_messages(broken) == [broken.encode("latin-1")]


class _CountingCalls(EngineSpy):
    """The real engine, counting its calls that carry a notification."""

    calls = 0

    def batch_transfer_sync(self, *args: Any) -> int:
        self.calls += 1
        return int(self._engine.batch_transfer_sync(*args))


def test_a_frame_holding_more_messages_than_a_run_comes_whole() -> None:
    """A sender frames at most ``MAX_RUN`` messages; more is a peer amplifying its
    notifications (four bytes each): one message, as it came, which the core drops."""
    assert len(decode_messages(encode_messages([b""] * MAX_RUN))) == MAX_RUN
    flood = encode_messages([b""] * (MAX_RUN + 1))
    assert decode_messages(flood) == [flood.encode("latin-1")]


def test_writes_queued_behind_one_another_run_together_each_notification_once_after_its_data(
    pair: Pair,
) -> None:
    """Batches queued towards one peer go in one engine call (a round trip each cost about
    1.4 ms over tcp); every write's bytes land and its message arrives once, in order,
    after its data, a notification sent alone and one framed like a run included."""
    a, b, peer, src, dst = pair
    spy = _CountingCalls(driver_of(a).engine)
    driver_of(a)._local.engine = spy
    block = 64 << 10
    writes, messages = [], []
    for i in range(40):
        lo = np.uint64(i * block)
        d = xk.Descriptors(
            np.array([np.uint64(src.ctypes.data) + lo]),
            np.array([np.uint64(dst.ctypes.data) + lo]),
            np.array([block], np.uint64),
        )
        message = RUN + b"%d" % i if i == 7 else b"w%d" % i
        writes.append(a.write(peer, xk.Descriptors.empty() if i == 20 else d, notify=message))
        messages.append(message)
    for w in writes:
        w.wait(30)
    assert [n.message for n in drain_until(b, 40, WAIT_S)] == messages
    moved = np.ones(40, bool)
    moved[20] = False
    whole = dst[: 40 * block].reshape(40, block)
    np.testing.assert_array_equal(whole[moved], src[: 40 * block].reshape(40, block)[moved])
    assert not whole[20].any()
    assert spy.calls < 40  # the writes queued while earlier ones ran went together
