"""The adapters driven as a careless engine would: odd argument dtypes, calls out of order,
request ids reused, refused writes, thousands of requests.

Each test runs real Sessions over the loopback and checks bytes, states or the process's
resident memory; none mocks a driver.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.adapters.sglang import KVManager, KVPoll, KVReceiver, KVSender, poll_and_all_reduce
from xferkit.adapters.vllm import (
    Blocks,
    ConnectorConfig,
    ConnectorMetadata,
    KVConnectorOutput,
    Load,
    Request,
    Role,
    SchedulerOutput,
    XferkitConnector,
    valid_tokens,
)
from xferkit.session import State

BS, BLOCKS, HEADS, DIM = 4, 8, 2, 8
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

# -- vLLM: block ids of any dtype ------------------------------------------------------------

ODD_EMPTY = ["U1", "S1", "M8[s]", "m8[s]", "V4"]


@pytest.mark.parametrize("dtype", ODD_EMPTY)
def test_an_empty_block_list_of_any_dtype_is_taken_or_refused_as_an_xfer_error(
    dtype: str,
) -> None:
    """Defect: an empty array of a dtype without ``<`` against an int (str, bytes,
    datetime, timedelta, void) passed the size check and then raised numpy's
    UFuncTypeError from the sign check in ``_ids``. Fixed: the sign is checked only on
    integer ids, so an empty list of any dtype is an empty list of blocks."""
    empty = np.array([], dtype=dtype)
    assert valid_tokens(empty, empty, BS, 12) == 12  # nothing failed: every token kept
    sched = XferkitConnector(Role.SCHEDULER, ConnectorConfig(block_size=BS))
    req = Request("r", [1, 2, 3], {"do_remote_decode": True}, 3, "finished_stopped")
    assert sched.request_finished(req, empty) == (False, None)  # type: ignore[arg-type]  # nothing to hand over
    with pytest.raises(xk.ArgumentError, match="block ids"):
        valid_tokens(np.array(["1"], dtype=dtype if dtype in ("U1", "S1") else "U1"), [], BS, 1)


# -- vLLM: one decode scheduler and worker, one prefill Session driven by hand -----------------


def _caches(fill: float = 0.0) -> dict[str, np.ndarray]:
    return {n: np.full((2, BLOCKS, BS, HEADS, DIM), fill, np.float32) for n in NAMES}


class Decode:
    """A decode instance's scheduler and worker connectors (TP 1) over its own caches."""

    def __init__(self) -> None:
        self.caches = _caches()
        self.sched = XferkitConnector(Role.SCHEDULER, ConnectorConfig(block_size=BS))
        self.worker = XferkitConnector(Role.WORKER, ConnectorConfig(block_size=BS))
        self.worker.register_kv_caches(self.caches)
        self.worker_session = self.worker.session
        self.sent: set[str] = set()

    def step(self, finished: set[str]) -> None:
        meta = self.sched.build_connector_meta(SchedulerOutput(finished))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        sent, received = self.worker.get_finished(finished)
        self.worker.clear_connector_metadata()
        self.sent |= sent
        self.sched.update_connector_output(KVConnectorOutput(sent, received))

    def blocks(self, ids: list[int]) -> np.ndarray:
        return np.stack([self.caches[n][:, ids] for n in NAMES])


@contextlib.contextmanager
def prefill_and_decode() -> Iterator[tuple[XferkitConnector, Decode]]:
    pre = XferkitConnector(Role.WORKER, ConnectorConfig(block_size=BS))
    pre.register_kv_caches(_caches(1.0))  # every prefill byte is 1.0: a landing shows
    dec = Decode()
    try:
        yield pre, dec
    finally:
        dec.worker.shutdown()
        pre.shutdown()


def _remote(rid: str, transfer: str, address: str) -> Request:
    params = {
        "do_remote_prefill": True,
        "remote_request_id": transfer,
        "remote_addresses": [address],
        "remote_num_blocks": 2,
    }
    return Request(rid, list(range(2 * BS)), kv_transfer_params=params)


def test_a_reused_request_id_cannot_lose_the_abort_of_its_earlier_load() -> None:
    """Defect: a decode request that ends while loading is aborted through the next metadata's
    ``aborts``; when the engine reused its id for a new request in the same step, that
    metadata carried the new load and the abort under one id, the worker expected the new
    load, then popped *it* for the abort: the earlier Receive was dropped un-aborted, the id
    was reported sent (its blocks freed) and the prefill's later write landed in the freed
    blocks (the new request also never finished). Fixed: ``get_num_new_matched_tokens``
    answers None (vLLM: ask again later) for an id whose earlier load is still being
    aborted, so the abort completes first and no byte lands after the blocks are freed."""
    with prefill_and_decode() as (pre, dec):
        assert pre.session is not None
        first = _remote("r", "t1", pre.session.address)
        count, load = dec.sched.get_num_new_matched_tokens(first, 0)
        assert load and count == 2 * BS
        dec.sched.update_state_after_alloc(first, Blocks([0, 1]), count)
        dec.step(set())  # the worker expects t1 into blocks 0 and 1; the prefill is late
        first.status = "finished_aborted"  # the client went away while it loaded
        assert dec.sched.request_finished(first, [0, 1]) == (True, None)  # blocks held
        again = _remote("r", "t2", pre.session.address)  # the engine reuses the id
        limit = time.monotonic() + 10
        while "r" not in dec.sent:
            assert time.monotonic() < limit, "the aborted load never ended"
            count, load = dec.sched.get_num_new_matched_tokens(again, 0)
            if count is not None and load:
                dec.sched.update_state_after_alloc(again, Blocks([2, 3]), count)
            dec.step({"r"})
            time.sleep(0.01)
        # vLLM frees blocks 0 and 1 now. The prefill finally writes t1:
        send = pre.session.offer("t1")
        send.write({"kv": [4, 5]}, last=True)
        with contextlib.suppress(xk.XferError):
            send.wait(10)
        time.sleep(0.2)
        assert not dec.blocks([0, 1]).any(), "the prefill's bytes landed in freed blocks"


def test_an_offer_whose_write_is_refused_holds_nothing_for_the_decode() -> None:
    """Defect: ``start_load_kv`` offered a finished prefill request, then its write was
    refused (a block id past the cache) and the Send was dropped while still offered: the
    Session kept the request until its deadline and a decode expecting it waited the whole
    ``request_timeout_s`` (60 s) for a prefill that would never write. Fixed: a Send whose
    write is refused is aborted, so the decode's Receive fails at once."""
    with prefill_and_decode() as (pre, dec):
        assert pre.session is not None and dec.worker_session is not None
        recv = dec.worker_session.expect("bad", [pre.session.address], {"kv": [0, 1]})
        meta = ConnectorMetadata({}, {"bad": np.array([0, BLOCKS + 5])})
        pre.bind_connector_metadata(meta)
        pre.start_load_kv(None)  # logged; the offered Send is aborted
        with pytest.raises(xk.RequestError):
            recv.wait(5)
        limit = time.monotonic() + 5
        while pre.get_finished({"bad"}) != ({"bad"}, set()):  # reported sent once FAILED
            assert time.monotonic() < limit, "the refused offer was never reported"
            time.sleep(0.01)
        assert not dec.blocks([0, 1]).any()


def test_a_request_finished_twice_cannot_free_blocks_its_first_send_still_reads() -> None:
    """Defect: a prefill request the scheduler finished twice (a careless engine's double
    free) was offered twice: the second ``offer`` was refused (the id was used), and its
    ``None`` replaced the first, live Send in the worker's table, so the id read as sent at
    once and vLLM freed the blocks the first Send would still read when the decode claimed
    it (the decode would get whatever the blocks held by then, DONE). Fixed: a second offer
    of an id whose Send is live is ignored (logged); the id is reported sent only once that
    Send is terminal."""
    with prefill_and_decode() as (pre, dec):
        assert pre.session is not None and dec.worker_session is not None
        for _ in range(2):  # two steps, each with the same finished request's offer
            pre.bind_connector_metadata(ConnectorMetadata({}, {"r": np.array([0, 1])}))
            pre.start_load_kv(None)
            assert pre.get_finished({"r"}) == (set(), set()), "reported sent while held"
            pre.clear_connector_metadata()
        recv = dec.worker_session.expect("r", [pre.session.address], {"kv": [2, 3]})
        assert recv.wait(10) is State.DONE
        assert (dec.blocks([2, 3]) == 1.0).all()
        limit = time.monotonic() + 5
        while pre.get_finished(set()) != ({"r"}, set()):
            assert time.monotonic() < limit, "the Send's end was never reported"
            time.sleep(0.01)


def test_worker_calls_out_of_order_raise_xfer_errors() -> None:
    """Every worker call before ``register_kv_caches``, or after ``shutdown``, is an
    XferError naming the call; none waits."""
    w = XferkitConnector(Role.WORKER, ConnectorConfig(block_size=BS))
    for call in (
        lambda: w.start_load_kv(None),
        lambda: w.get_handshake_metadata(),
        lambda: w.wait_for_layer_load(NAMES[0]),
        lambda: w.save_kv_layer(NAMES[0], None, None),
    ):
        with pytest.raises(xk.XferError, match="register_kv_caches"):
            call()
    w.register_kv_caches(_caches())
    with pytest.raises(xk.XferError, match="no connector metadata"):
        w.start_load_kv(None)
    with pytest.raises(xk.XferError, match="registered already"):
        w.register_kv_caches(_caches())
    assert w.session is not None
    w.bind_connector_metadata(
        ConnectorMetadata({"x": Load("tx", (w.session.address,), np.array([0]))}, {})
    )
    w.shutdown()
    w.shutdown()  # twice: nothing left to release
    w.start_load_kv(None)  # the closed Session refuses the expect: that load fails
    assert w.get_finished(set()) == (set(), {"x"})
    assert w.get_block_ids_with_load_errors() == {0}


# -- sglang: calls out of order, rooms reused, many requests -----------------------------------

SLOTS = 32


def _manifest(fill: float) -> tuple[xk.Manifest, np.ndarray]:
    kv = np.full((SLOTS, BS, HEADS, DIM), fill, np.float32)
    region = xk.Region.from_array(kv, pool="kv", name="k", layer=0)
    return xk.Manifest.build([region]), kv


@contextlib.contextmanager
def sglang_pair(**options: Any) -> Iterator[tuple[KVManager, KVManager, np.ndarray]]:
    (pm, _), (dm, dkv) = _manifest(1.0), _manifest(0.0)
    pre = KVManager(xk.open_backend("loopback"), pm, "prefill", aux_pool=None, **options)
    dec = KVManager(xk.open_backend("loopback"), dm, "decode", aux_pool=None, **options)
    try:
        yield pre, dec, dkv
    finally:
        dec.close(5)
        pre.close(5)


def _poll(pollers: list[Any]) -> list[int]:
    return poll_and_all_reduce(pollers, lambda rows: rows)


def _until(pollers: list[Any], want: tuple[KVPoll, ...], within: float = 10.0) -> list[int]:
    limit = time.monotonic() + within
    while True:
        got = _poll(pollers)
        if all(g in want for g in got):
            return got
        assert time.monotonic() < limit, got
        time.sleep(0.005)


def test_sglang_out_of_order_and_reused_rooms_raise_or_fail_never_corrupt() -> None:
    """A second sender for a live room, a send past the last chunk, metadata after an abort,
    aborts twice and polls after the end: each an XferError or a Failed poll; the honest
    request on the same room's first sender lands byte-exact."""
    with sglang_pair() as (pre, dec, dkv):
        send = KVSender(pre, None, 7)
        with pytest.raises(xk.XferError, match="already used"):
            KVSender(pre, None, 7)
        recv = KVReceiver(dec, pre.bootstrap_addr or "", 7)
        recv.init()
        recv.send_metadata([3, 4])
        send.init(2)
        send.send([10, 11])
        with pytest.raises(xk.XferError):
            send.send([])  # past the last chunk
        assert _until([recv, send], (KVPoll.Success,)) == [KVPoll.Success] * 2
        assert (dkv[[3, 4]] == 1.0).all() and not dkv[np.r_[0:3, 5:SLOTS]].any()
        send.abort()  # after Success: nothing changes
        assert send.poll() is KVPoll.Success
        late = KVReceiver(dec, pre.bootstrap_addr or "", 8)
        late.abort()
        late.abort()
        assert _until([late], (KVPoll.Failed,)) == [KVPoll.Failed]
        with pytest.raises(xk.RequestError):
            late.send_metadata([5])
        with pytest.raises(xk.RequestError):
            late.failure_exception()
        assert not dkv[5].any()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _rounds(pre: KVManager, dec: KVManager, first: int, n: int, batch: int = 50) -> None:
    for start in range(first, first + n, batch):
        rooms = range(start, start + batch)
        pairs = []
        for room in rooms:
            s, r = KVSender(pre, None, room), KVReceiver(dec, pre.bootstrap_addr or "", room)
            r.init()
            r.send_metadata([room % SLOTS])
            s.init(1)
            s.send([(room * 7) % SLOTS])
            pairs += [s, r]
        assert _until(pairs, (KVPoll.Success,), 30) == [KVPoll.Success] * len(pairs)


def test_thousands_of_sglang_requests_keep_resident_memory_bounded() -> None:
    """2000 requests through one manager pair after 500 to warm up: the process's resident
    memory (from /proc) grows by less than 24 MiB, so no per-request table keeps growing."""
    with sglang_pair() as (pre, dec, _):
        _rounds(pre, dec, 0, 500)
        gc.collect()
        before = _rss()
        _rounds(pre, dec, 500, 2000)
        gc.collect()
        grown = _rss() - before
    assert grown < 24 << 20, f"resident memory grew {grown / 2**20:.1f} MiB over 2000 requests"


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
PARAM_KEYS = ["do_remote_prefill", "remote_request_id", "remote_addresses", "remote_num_blocks"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    key=st.sampled_from(PARAM_KEYS),
    value=json_values,
    blocks=st.one_of(st.lists(st.integers(-2, 2**70), max_size=3), json_values),
)
def test_kv_transfer_params_as_a_proxy_relays_them_any_json_give_a_load_or_an_xfer_error(
    key: str, value: Any, blocks: Any
) -> None:
    """``kv_transfer_params`` arrive as JSON through a proxy: any JSON value for any key, and
    any block list, is a load, nothing, or an XferError; never numpy's or Python's errors."""
    sched = XferkitConnector(Role.SCHEDULER, ConnectorConfig(block_size=BS))
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_request_id": "t",
        "remote_addresses": ["tcp://127.0.0.1:1"],
        "remote_num_blocks": 1,
        key: value,
    }
    req = Request("r", list(range(BS)), kv_transfer_params=params)
    with contextlib.suppress(xk.XferError):
        count, _ = sched.get_num_new_matched_tokens(req, 0)
        ids = blocks if isinstance(blocks, list) else []  # vLLM's blocks: a list of ids
        sched.update_state_after_alloc(req, Blocks(ids), count or 0)
    with contextlib.suppress(xk.XferError):
        sched.request_finished(req, blocks)
    meta = sched.build_connector_meta(SchedulerOutput())
    for load in meta.loads.values():  # what a worker would expect: well-formed
        assert isinstance(load.transfer_id, str) and load.blocks.dtype == np.int64
