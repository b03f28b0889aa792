"""The vLLM-shaped connector driven as vLLM's scheduler and model runner drive theirs.

Two instances in one process, each a scheduler connector and a worker connector
over a real Session on the loopback: a prefill finishes a request, its params
reach the decode, the decode loads it. Each step runs vLLM's order (schedule,
``update_state_after_alloc``, ``build_connector_meta``; on the worker bind, load,
per layer wait and save, ``wait_for_save``, ``get_finished``, failed blocks;
then failed blocks first, finished requests, sends and receives freed).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit.adapters.vllm import (
    Blocks,
    ConnectorConfig,
    ConnectorMetadata,
    Handshake,
    KVConnectorOutput,
    Policy,
    Request,
    Role,
    SchedulerOutput,
    XferkitConnector,
    valid_tokens,
)
from xferkit_loopback import Faults

BS, LAYERS, BLOCKS, HEADS, DIM = 4, 3, 16, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def computed(prompt: list[int]) -> dict[str, np.ndarray]:
    """What "computing" a prompt writes into its blocks: K and V per layer, from the tokens."""
    n = math.ceil(len(prompt) / BS)
    rng = np.random.default_rng(prompt)
    return {name: rng.standard_normal((2, n, BS, HEADS, DIM), np.float32) for name in NAMES}


class Instance:
    """One engine instance (TP 1): its block pool, requests and both connector roles."""

    def __init__(self, policy: Policy = "recompute", tp: int = 1, **config: Any) -> None:
        shape = (2, BLOCKS, BS, HEADS // tp, DIM)  # each TP rank holds its share of the heads
        self.caches = [{n: np.zeros(shape, np.float32) for n in NAMES} for _ in range(tp)]
        self.sched = XferkitConnector(Role.SCHEDULER, ConnectorConfig(0, tp, BS, **config))
        self.workers = [
            XferkitConnector(Role.WORKER, ConnectorConfig(r, tp, BS, **config)) for r in range(tp)
        ]
        for w, caches in zip(self.workers, self.caches, strict=True):
            w.register_kv_caches(caches)
        self.worker = self.workers[0]
        self.sched.set_xfer_handshake_metadata(
            {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        )
        self.reports: dict[tuple[str, str], int] = {}  # (sent | received, id) -> workers so far
        self.policy = policy
        self.free = list(range(BLOCKS))
        self.blocks: dict[str, list[int]] = {}
        self.waiting: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.held: dict[str, list[int]] = {}  # request_finished said delay_free
        self.just_finished: set[str] = set()  # the next SchedulerOutput's finished_req_ids
        self.outcome: dict[str, str] = {}  # request id -> its final status
        self.params: dict[str, dict[str, Any] | None] = {}
        self.kv: dict[str, dict[str, np.ndarray]] = {}  # a request's blocks when it finished
        self.failed: dict[str, set[int]] = {}
        self.recomputed: set[str] = set()
        self.cache: dict[str, list[int]] = {}  # request id -> its prompt's first blocks, cached

    def compute(self, req: Request) -> None:
        ids = self.blocks[req.request_id]
        share = HEADS // len(self.caches)
        for name, kv in computed(req.prompt_token_ids).items():
            for r, caches in enumerate(self.caches):
                caches[name][:, ids] = kv[:, :, :, r * share : (r + 1) * share]
        req.num_computed_tokens = len(req.prompt_token_ids)

    def finish(self, req: Request, status: str) -> None:
        rid, ids = req.request_id, self.blocks.pop(req.request_id)
        req.status = status
        self.kv[rid] = {n: np.concatenate([c[n][:, ids] for c in self.caches], 3) for n in NAMES}
        delay, self.params[rid] = self.sched.request_finished(req, ids)
        if delay:
            self.held[rid] = ids
        else:
            self.free += ids
        self.outcome[rid] = status
        self.just_finished.add(rid)

    def step(self) -> None:
        for req in self.waiting:
            hit = self.cache.pop(req.request_id, [])  # vLLM's local prefix cache hit
            count, load_async = self.sched.get_num_new_matched_tokens(req, len(hit) * BS)
            need = math.ceil(len(req.prompt_token_ids) / BS) - len(hit)
            ids = [self.free.pop(0) for _ in range(need)]
            self.blocks[req.request_id] = hit + ids
            assert count is not None
            self.sched.update_state_after_alloc(req, Blocks(ids), count if load_async else 0)
            if load_async:
                self.remote[req.request_id] = req
            else:  # a local prefill of max_tokens=1: computed and finished in this step
                self.compute(req)
                self.finish(req, "finished_length_capped")
        self.waiting = []
        finished, self.just_finished = self.just_finished, set()
        meta = self.sched.build_connector_meta(SchedulerOutput(finished))
        sending, receiving, failed = set(), set(), set()
        for w, caches in zip(self.workers, self.caches, strict=True):
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            for name in NAMES:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, caches[name], None)
            w.wait_for_save()
            sent, received = w.get_finished(finished)
            failed |= w.get_block_ids_with_load_errors()  # unioned over the workers
            w.clear_connector_metadata()
            sending |= self.count("sent", sent)
            receiving |= self.count("received", received)
        self.sched.update_connector_output(KVConnectorOutput(sending, receiving))
        for rid in receiving:  # failed blocks first: vLLM's kv_load_failure_policy
            req = self.remote.pop(rid)
            bad = failed & set(self.blocks[rid])
            if bad:
                self.failed[rid] = bad
                keep = valid_tokens(self.blocks[rid], sorted(bad), BS, len(req.prompt_token_ids))
                if self.policy == "fail":
                    self.finish(req, "finished_error")
                    continue
                req.num_computed_tokens = keep
                self.compute(req)  # recomputed here, into the blocks that failed
                self.recomputed.add(rid)
            else:
                req.num_computed_tokens = len(req.prompt_token_ids)
            self.finish(req, "finished_stopped")  # decoded, then stopped
        for rid in sending:
            self.free += self.held.pop(rid)

    def abort(self, rid: str) -> None:
        """The client went away: vLLM finishes the request (aborted) wherever it is."""
        self.finish(self.remote.pop(rid), "finished_aborted")

    def count(self, what: str, ids: set[str]) -> set[str]:
        """vLLM's aggregation: an id is done once every worker reported it."""
        out = set()
        for rid in ids:
            n = self.reports[what, rid] = self.reports.get((what, rid), 0) + 1
            if n == len(self.workers):
                out.add(rid)
                del self.reports[what, rid]
        return out

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def run(instances: list[Instance], until: Callable[[], bool], timeout: float = 15.0) -> None:
    limit = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < limit, "the engines did not get there in time"
        for i in instances:
            i.step()
        time.sleep(0.002)


def decode_of(prefill: Instance, rid: str, prompt: list[int]) -> Request:
    """What a proxy does: the prefill's params become the decode request's."""
    params = prefill.params[rid]
    assert params is not None and params["remote_request_id"] == rid
    return Request(f"d-{rid}", prompt, kv_transfer_params=dict(params))


def test_a_prefill_hands_its_requests_to_a_decode_byte_exact() -> None:
    pre, dec = Instance(), Instance()
    dec.free.reverse()  # the decode's blocks are other ids than the prefill's
    prompts = {"a": list(range(10)), "b": list(range(100, 113))}  # 3 and 4 blocks
    try:
        for rid, prompt in prompts.items():
            pre.waiting.append(Request(rid, prompt, {"do_remote_decode": True}))
        run([pre], lambda: set(pre.params) == set(prompts))
        assert set(pre.held) == set(prompts)
        params, session = pre.params["a"], pre.worker.session
        assert params is not None and session is not None
        assert params["remote_addresses"] == [session.address]
        assert params["remote_num_blocks"] == 3 and params["do_remote_prefill"] is True
        for _ in range(25):  # no decode yet: the blocks stay held, nothing reads as sent
            pre.step()
            time.sleep(0.004)
        assert set(pre.held) == set(prompts) and len(pre.free) == BLOCKS - 7
        held = {rid: list(ids) for rid, ids in pre.held.items()}
        for rid, prompt in prompts.items():
            dec.waiting.append(decode_of(pre, rid, prompt))
        run([pre, dec], lambda: len(dec.outcome) == 2 and not pre.held)
        assert sorted(pre.free) == list(range(BLOCKS)) and sorted(dec.free) == list(range(BLOCKS))
        for rid, prompt in prompts.items():
            assert dec.outcome[f"d-{rid}"] == "finished_stopped"
            want = computed(prompt)
            for name in NAMES:
                np.testing.assert_array_equal(dec.kv[f"d-{rid}"][name], want[name])
                np.testing.assert_array_equal(pre.kv[rid][name], want[name])
        assert not dec.failed and not dec.recomputed
        assert set(held["a"]).isdisjoint(set(held["b"]))
    finally:
        pre.close()
        dec.close()


def test_a_local_prefix_hit_loads_only_the_blocks_after_it() -> None:
    """The decode's prefix cache holds a prompt's first blocks: vLLM computes them locally
    (``num_computed_tokens``) and allocates new blocks for the rest only. The prefill still
    writes every block; the load skips the ones the cache holds. The cached blocks hold the
    decode's own copy (a marker here, so a write into them shows) and keep it; the new
    blocks hold the prompt's blocks after the prefix, byte-exact (without the skip they
    would get its first ones); the prefill's blocks free once reported sent."""
    pre, dec = Instance(), Instance()
    dec.free.reverse()
    prompts = {"a": list(range(13)), "b": list(range(50, 59))}  # 4 and 3 blocks
    hits = {"a": 2, "b": 1}  # blocks cached on the decode
    try:
        for rid, prompt in prompts.items():
            pre.waiting.append(Request(rid, prompt, {"do_remote_decode": True}))
        run([pre], lambda: set(pre.params) == set(prompts))
        assert set(pre.held) == set(prompts) and len(pre.free) == BLOCKS - 7
        for rid, n in hits.items():
            cached = dec.cache[f"d-{rid}"] = [dec.free.pop() for _ in range(n)]
            for name in NAMES:
                dec.caches[0][name][:, cached] = -float(n)
            dec.waiting.append(decode_of(pre, rid, prompts[rid]))
        run([pre, dec], lambda: len(dec.outcome) == 2 and not pre.held)
        assert sorted(pre.free) == list(range(BLOCKS)) and sorted(dec.free) == list(range(BLOCKS))
        for rid, prompt in prompts.items():
            n, got, want = hits[rid], dec.kv[f"d-{rid}"], computed(prompt)
            assert dec.outcome[f"d-{rid}"] == "finished_stopped"
            for name in NAMES:
                np.testing.assert_array_equal(got[name][:, n:], want[name][:, n:])
                assert (got[name][:, :n] == -float(n)).all()
        assert not dec.failed and not dec.recomputed
    finally:
        pre.close()
        dec.close()


def test_prefill_tp2_hands_over_to_decode_tp1_once_both_ranks_sent() -> None:
    """Each prefill rank writes its half of the heads; the decode names both addresses and
    reports the request received once; the prefill frees once both its workers said sent."""
    pre, dec = Instance(tp=2), Instance()
    prompt = list(range(30, 41))  # 3 blocks
    try:
        pre.waiting.append(Request("r", prompt, {"do_remote_decode": True}))
        run([pre], lambda: "r" in pre.params)
        params = pre.params["r"]
        assert params is not None and len(params["remote_addresses"]) == 2
        assert params["tp_size"] == 2
        dec.waiting.append(decode_of(pre, "r", prompt))
        run([pre, dec], lambda: "d-r" in dec.outcome and not pre.held)
        assert dec.outcome["d-r"] == "finished_stopped" and not dec.failed
        want = computed(prompt)
        for name in NAMES:
            np.testing.assert_array_equal(dec.kv["d-r"][name], want[name])
        assert not pre.reports and sorted(pre.free) == list(range(BLOCKS))
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_reports_its_blocks_and_the_policy_decides(
    policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    faults = Faults(fail_post_at=1)  # the prefill's first write fails in its driver
    pre = Instance(backend=lambda: xk.open_backend("loopback", faults=faults))
    dec = Instance(policy=policy)
    prompt = list(range(7, 16))  # 3 blocks
    try:
        pre.waiting.append(Request("r", prompt, {"do_remote_decode": True}))
        run([pre], lambda: "r" in pre.params)
        dec.waiting.append(decode_of(pre, "r", prompt))
        run([pre, dec], lambda: "d-r" in dec.outcome and not pre.held)
        assert "d-r" not in dec.blocks and sorted(dec.free) == list(range(BLOCKS))
        assert len(dec.failed["d-r"]) == 3  # every block of the load, none other
        assert "injected failure of post #1" in caplog.text  # the root cause, logged
        assert sorted(pre.free) == list(range(BLOCKS))  # the failed Send freed its blocks
        if policy == "fail":
            assert dec.outcome["d-r"] == "finished_error" and not dec.recomputed
        else:
            assert dec.outcome["d-r"] == "finished_stopped" and dec.recomputed == {"d-r"}
            want = computed(prompt)
            for name in NAMES:
                np.testing.assert_array_equal(dec.kv["d-r"][name], want[name])
    finally:
        pre.close()
        dec.close()


def test_a_decode_request_aborted_mid_load_keeps_its_blocks_until_nothing_can_land() -> None:
    """Push's hazard: freed decode blocks a prefill still writes into. A request that ends
    while receiving keeps its blocks (delay_free) until its aborted Receive is FAILED."""
    faults = Faults(stall_post_at=1)  # the write stays in the prefill's driver
    pre = Instance(backend=lambda: xk.open_backend("loopback", faults=faults))
    dec = Instance()
    prompt = list(range(9))  # 3 blocks
    try:
        pre.waiting.append(Request("r", prompt, {"do_remote_decode": True}))
        run([pre], lambda: "r" in pre.params)
        dec.waiting.append(decode_of(pre, "r", prompt))
        run([pre, dec], lambda: bool(dec.worker._recvs))  # expected
        recv, _ = dec.worker._recvs["d-r"]
        assert recv is not None
        run([pre, dec], lambda: recv.poll() is xk.State.WAITING or recv.done, timeout=5)
        for _ in range(10):  # the write is stalled: nothing finishes
            pre.step()
            dec.step()
        assert "d-r" in dec.remote and not recv.done
        dec.abort("d-r")
        assert set(dec.held) == {"d-r"} and len(dec.free) == BLOCKS - 3  # kept, not freed
        run([pre, dec], lambda: not dec.held and not pre.held)
        assert recv.poll() is xk.State.FAILED  # freed only once nothing can land
        assert recv.error is not None and recv.error.stage == "abort"
        assert sorted(dec.free) == sorted(pre.free) == list(range(BLOCKS))
        assert dec.outcome["d-r"] == "finished_aborted" and not dec.failed
    finally:
        pre.close()
        dec.close()


def test_an_unclaimed_hold_frees_at_the_lease_and_a_late_decode_recomputes() -> None:
    pre, dec = Instance(session={"lease_s": 0.3}), Instance()
    prompt = list(range(5))
    try:
        started = time.monotonic()  # before the offer: the lease runs from it
        pre.waiting.append(Request("r", prompt, {"do_remote_decode": True}))
        run([pre], lambda: "r" in pre.params)
        run([pre], lambda: not pre.held)  # the Session's lease ended the hold
        assert time.monotonic() - started >= 0.3 and sorted(pre.free) == list(range(BLOCKS))
        dec.waiting.append(decode_of(pre, "r", prompt))
        run([pre, dec], lambda: "d-r" in dec.outcome)
        assert dec.recomputed == {"d-r"} and len(dec.failed["d-r"]) == 2
        np.testing.assert_array_equal(dec.kv["d-r"][NAMES[0]], computed(prompt)[NAMES[0]])
    finally:
        pre.close()
        dec.close()


def test_a_send_is_reported_only_once_vllm_named_the_request_finished() -> None:
    """vLLM's rule: a finished-sending id must be one get_finished was given (now or
    before). A hold that ended at its lease waits in the worker until then."""
    pre = Instance(session={"lease_s": 0.1})
    try:
        pre.worker.bind_connector_metadata(ConnectorMetadata({}, {"r": np.array([1, 2])}))
        pre.worker.start_load_kv(None)
        send = pre.worker._sends["r"]
        assert send is not None
        limit = time.monotonic() + 10
        while not send.done:
            assert pre.worker.get_finished(set()) == (set(), set())
            assert time.monotonic() < limit
            time.sleep(0.01)
        assert pre.worker.get_finished({"other"}) == (set(), set())
        assert pre.worker.get_finished({"r"}) == ({"r"}, set())
        assert pre.worker.get_finished({"r"}) == (set(), set())  # once
    finally:
        pre.close()


def test_the_scheduler_side_offers_only_what_finished_well() -> None:
    s = XferkitConnector(Role.SCHEDULER, ConnectorConfig(block_size=BS))
    s.set_xfer_handshake_metadata({0: Handshake(0, "tcp://127.0.0.1:9")})
    aborted = Request("x", [1, 2], {"do_remote_decode": True}, 2, "finished_aborted")
    assert s.request_finished(aborted, [3]) == (False, None)
    plain = Request("y", [1, 2], None, 2, "finished_stopped")
    assert s.request_finished(plain, [4]) == (False, None)
    ok = Request("z", [1, 2], {"do_remote_decode": True}, 2, "finished_stopped")
    delay, params = s.request_finished(ok, ([5, 6],))  # one KV-cache group, HMA's shape
    assert delay and params is not None and params["remote_num_blocks"] == 2
    meta = s.build_connector_meta(SchedulerOutput())
    assert list(meta.offers) == ["z"] and meta.offers["z"].tolist() == [5, 6] and not meta.loads
    assert not s.build_connector_meta(SchedulerOutput()).offers  # each offer once
    d = Request("d", [1] * 9, dict(params), 0)
    assert s.get_num_new_matched_tokens(d, 0) == (9, True)
    assert s.get_num_new_matched_tokens(d, 0) == (9, True)  # no side effects
    assert s.get_num_new_matched_tokens(d, 4) == (5, True)  # a local hit: the rest loads
    assert s.get_num_new_matched_tokens(d, 9) == (0, False)  # all of it computed here
    with pytest.raises(xk.ArgumentError, match=r"3 tokens.*not whole blocks of 4"):
        s.get_num_new_matched_tokens(d, 3)
    s.update_state_after_alloc(d, Blocks([9, 8, 7]), 9)
    s.update_state_after_alloc(d, Blocks([1]), 9)  # the second call, after the load: ignored
    load = s.build_connector_meta(SchedulerOutput()).loads["d"]
    assert load.transfer_id == "z" and load.blocks.tolist() == [9, 8]
    assert load.sources == ("tcp://127.0.0.1:9",) and load.skip == 0
    hit = Request("h", [1] * 9, {**params, "remote_num_blocks": 3}, 0)
    with pytest.raises(xk.ArgumentError, match=r"3 tokens.*not whole blocks"):
        s.update_state_after_alloc(hit, Blocks([6, 5]), 6)
    s.update_state_after_alloc(hit, Blocks([6, 5]), 5)  # 4 tokens (a block) cached here
    load = s.build_connector_meta(SchedulerOutput()).loads["h"]
    assert load.skip == 1 and load.blocks.tolist() == [6, 5]
    with pytest.raises(xk.XferError, match="worker-side"):
        s.start_load_kv(None)


@given(
    st.lists(st.integers(0, 30), unique=True, max_size=12),
    st.sets(st.integers(0, 30), max_size=6),
    st.integers(1, 8),
    st.integers(0, 100),
)
def test_valid_tokens_stop_at_the_first_failed_block(
    blocks: list[int], failed: set[int], block_size: int, computed_tokens: int
) -> None:
    first = next((i for i, b in enumerate(blocks) if b in failed), None)
    want = computed_tokens if first is None else min(computed_tokens, first * block_size)
    assert valid_tokens(blocks, sorted(failed), block_size, computed_tokens) == want


EXPECTED = {  # KVConnectorBase_V1's methods this connector implements, and their parameters
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"],
    "update_connector_output": ["connector_output"],
    "request_finished": ["request", "block_ids"],
    "set_xfer_handshake_metadata": ["metadata"],
    "register_kv_caches": ["kv_caches"],
    "get_handshake_metadata": [],
    "bind_connector_metadata": ["connector_metadata"],
    "clear_connector_metadata": [],
    "start_load_kv": ["forward_context"],
    "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata"],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "get_block_ids_with_load_errors": [],
    "shutdown": [],
}


def _named(fn: Callable[..., Any]) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds][1:]


def test_the_methods_are_vllms() -> None:
    """Against vLLM's own base class where vLLM is installed, else against the table above
    (read from vLLM's base.py): same names, same parameters."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except ImportError:
        reference = EXPECTED
    else:
        reference = {name: _named(getattr(KVConnectorBase_V1, name)) for name in EXPECTED}
    ours = {name: _named(getattr(XferkitConnector, name)) for name in EXPECTED}
    assert ours == reference
    assert reference == EXPECTED  # the table still says what vLLM says


anything = st.one_of(
    st.none(),
    st.integers(-3, 3),
    st.text(max_size=4),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 3), max_size=2),
    st.builds(object),
    st.builds(lambda: np.zeros((2, 3), np.float32)),
    st.builds(lambda: Request("q", [1, 2], {"do_remote_prefill": True})),
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(EXPECTED)), st.lists(anything, min_size=0, max_size=3))
def test_any_argument_succeeds_or_raises_an_xfer_error(name: str, args: list[Any]) -> None:
    for role in Role:
        conn = XferkitConnector(role, ConnectorConfig(block_size=BS))
        method = getattr(conn, name)
        count = len(_named(getattr(XferkitConnector, name)))
        with contextlib.suppress(xk.XferError):
            method(*(args + [None] * count)[:count])
        assert conn.session is None  # nothing junk was registered with


def test_connector_arguments_are_checked() -> None:
    with pytest.raises(xk.XferError, match="role"):
        XferkitConnector("worker")  # type: ignore[arg-type]
    with pytest.raises(xk.XferError, match="tp_rank"):
        XferkitConnector(Role.WORKER, ConnectorConfig(tp_rank=2, tp_size=2))
    with pytest.raises(xk.XferError, match="session"):
        XferkitConnector(Role.WORKER, ConnectorConfig(session="lease_s=1"))  # type: ignore[arg-type]
    with pytest.raises(xk.XferError, match="Handshake per TP rank"):
        XferkitConnector(Role.SCHEDULER).set_xfer_handshake_metadata({1: None, "a": None})  # type: ignore[dict-item]
    w = XferkitConnector(Role.WORKER)
    with pytest.raises(xk.XferError, match="no layer number"):
        w.register_kv_caches({"attn": np.zeros((2, 4, 4, 2, 8), np.float32)})
    with pytest.raises(xk.XferError, match="shape"):
        w.register_kv_caches({"layers.0": np.zeros((4, 4), np.float32)})
    with pytest.raises(xk.XferError, match="register_kv_caches"):
        w.start_load_kv(None)
    assert isinstance(ConnectorMetadata({}, {}), ConnectorMetadata)
