"""The sglang-shaped adapter, driven the way sglang's prefill and decode schedulers drive it.

Every rank is a real Session over the loopback in this process. The schedulers
run in lockstep: per step each TP rank polls all its in-flight requests, the
group's rows are all-reduced with MIN (``xferkit.group.reduce``, what the
engine's collective computes), prefill sends one chunk per request as it
"computes" it, and slots are freed only on the group's Success or Failed.
Bytes are checked against the reference model.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk
from xferkit import group
from xferkit.adapters.sglang import (
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    poll_and_all_reduce,
    summarize,
    verdicts,
)
from xferkit.session import RequestError, State
from xferkit.testing import Reference, RegionSpec, gdn_hybrid

FAST = {"heartbeat_s": 0.2, "dead_after_s": 2.0, "handshake_timeout_s": 5.0}
PAGE = 16  # tokens per KV page (KVManager(page_size=)): decode_prefix_len is in tokens
SLOTS = {"kv": 24, "state": 6, "aux": 6}
AUX = RegionSpec(pool="aux", name="first_token", layer=0, shape=(16,), itemsize=4)
TERMINAL = (KVPoll.Failed, KVPoll.Success)
SGLANG_KVPOLL = {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3,
                 "Success": 4}  # fmt: skip
"""sglang's KVPoll (python/sglang/srt/disaggregation/base/conn.py), checked against sglang
itself where it is importable."""


@dataclass
class World:
    ref: Reference
    pre: list[KVManager]
    dec: list[KVManager]

    @property
    def addr(self) -> str:
        return self.pre[0].bootstrap_addr or ""

    def close(self) -> None:
        for m in self.pre + self.dec:
            m.close(5)


@contextlib.contextmanager
def world(src_tp: int, dst_tp: int, **options: Any) -> Iterator[World]:
    """Prefill TP ``src_tp`` (rank 0 serves the group, the rest join it), decode TP ``dst_tp``."""
    ref = Reference(
        [*gdn_hybrid(4), AUX], src_tp=src_tp, dst_tp=dst_tp, src_slots=SLOTS, dst_slots=SLOTS
    )
    opts = {**FAST, **options}
    first = KVManager(xk.open_backend("loopback"), ref.srcs[0].manifest, "prefill", **opts)
    pre = [first] + [
        KVManager(
            xk.open_backend("loopback"), r.manifest, "prefill", bootstrap=first.session.address,
            **opts,
        )
        for r in ref.srcs[1:]
    ]  # fmt: skip
    dec = [KVManager(xk.open_backend("loopback"), r.manifest, "decode", **opts) for r in ref.dsts]
    w = World(ref, pre, dec)
    try:
        yield w
    finally:
        w.close()


def group_poll(per_rank: Sequence[Sequence[KVSender | KVReceiver]]) -> list[int]:
    """One scheduler step's poll over a TP group in lockstep: every rank's rows, reduced
    with MIN as the collective would, read back on every rank (the verdicts must agree)."""
    mine = [summarize(p) for p in per_rank]
    reduced = group.reduce(mine)
    got = [verdicts(p, m, reduced) for p, m in zip(per_rank, mine, strict=True)]
    assert all(g == got[0] for g in got), got
    return got[0]


@dataclass
class Req:
    room: int
    src_kv: list[int]  # the prefill's pages, in order
    dst_kv: list[int]  # the decode's pages
    src_state: int
    dst_state: int
    aux: int  # the same aux row index on both sides (each side allocates its own in sglang)
    chunk: int = 2  # pages per prefill chunk
    prefix: int = 0  # pages the decode's radix cache holds (dst_kv: the pages after them)
    senders: list[KVSender] = field(default_factory=list)
    receivers: list[KVReceiver] = field(default_factory=list)
    sent: int = 0
    inited: bool = False
    allocated: bool = False
    prefill_end: int | None = None
    decode_end: int | None = None
    decode_error: str = ""
    prefill_error: str = ""


class Schedulers:
    """sglang's prefill and decode scheduler loops, for one request list, in lockstep."""

    def __init__(self, w: World, reqs: list[Req]) -> None:
        self.w, self.reqs = w, reqs
        self.freed_src: list[int] = []  # prefill pages freed, in order
        self.steps = 0

    def admit(self, r: Req) -> None:
        """The router sends the request to prefill and decode at once."""
        r.senders = [KVSender(m, None, r.room) for m in self.w.pre]
        r.receivers = [KVReceiver(m, self.w.addr, r.room) for m in self.w.dec]
        for recv in r.receivers:
            recv.init(0)

    def step(self, hook: Callable[[Req], None] | None = None) -> None:
        self.steps += 1
        live = [r for r in self.reqs if r.decode_end is None]
        if live:
            polls = group_poll([[r.receivers[i] for r in live] for i in range(len(self.w.dec))])
            for r, poll in zip(live, polls, strict=True):
                self._decode(r, KVPoll(poll))
        live = [r for r in self.reqs if r.prefill_end is None]
        if live:
            polls = group_poll([[r.senders[i] for r in live] for i in range(len(self.w.pre))])
            for r, poll in zip(live, polls, strict=True):
                self._prefill(r, KVPoll(poll))
        if hook is not None:
            for r in self.reqs:
                hook(r)

    def _decode(self, r: Req, poll: KVPoll) -> None:
        if poll is KVPoll.WaitingForInput and not r.allocated:
            r.allocated = True  # pre-allocated: name the pages to the prefill ranks
            for recv in r.receivers:
                recv.send_metadata(
                    np.array(r.dst_kv, np.int32), r.aux, [r.dst_state], r.prefix * PAGE
                )
        elif poll in TERMINAL:
            r.decode_end = poll
            if poll is KVPoll.Failed:
                r.decode_error = _cause(r.receivers)

    def _prefill(self, r: Req, poll: KVPoll) -> None:
        if poll is KVPoll.WaitingForInput and not r.inited:
            r.inited = True
            for s in r.senders:
                s.init(len(r.src_kv), r.aux)
        if poll in TERMINAL:
            r.prefill_end = poll
            self.freed_src += r.src_kv  # only now: nothing reads them any more
            if poll is KVPoll.Failed:
                r.prefill_error = _cause(r.senders)
            return
        if r.inited and r.sent < len(r.src_kv):  # one more chunk computed this step
            end = min(r.sent + r.chunk, len(r.src_kv))
            last = end == len(r.src_kv)
            for s in r.senders:
                s.send(np.array(r.src_kv[r.sent : end], np.int32), [r.src_state] if last else None)
            r.sent = end

    def run(self, timeout: float = 20.0, hook: Callable[[Req], None] | None = None) -> None:
        limit = time.monotonic() + timeout
        while any(r.decode_end is None or r.prefill_end is None for r in self.reqs):
            assert time.monotonic() < limit, [
                (r.room, r.decode_end, r.prefill_end) for r in self.reqs
            ]
            self.step(hook)
            time.sleep(0.002)


def _cause(pollers: Sequence[KVSender | KVReceiver]) -> str:
    """The text sglang would put in the request's abort: the rank that saw the first failure."""
    (first,) = [p for p in pollers if p.reports_root_cause][:1] or pollers[:1]
    with pytest.raises(RequestError) as info:
        first.failure_exception()
    return str(info.value)


def _slots(reqs: Sequence[Req]) -> dict[str, tuple[list[int], list[int]]]:
    """What the reference expects for these requests, per pool: (source, destination)."""
    return {
        "kv": (
            [p for r in reqs for p in r.src_kv[r.prefix :]],
            [p for r in reqs for p in r.dst_kv],
        ),
        "state": ([r.src_state for r in reqs], [r.dst_state for r in reqs]),
        "aux": ([r.aux for r in reqs], [r.aux for r in reqs]),
    }


def test_kvpoll_is_sglangs() -> None:
    """Checked against sglang's own classes where it is installed, else its documented
    values; State has the same numbers, so a TP group's MIN means the same in both."""
    try:
        from sglang.srt.disaggregation.base import conn  # type: ignore[import-not-found]
    except ImportError:
        theirs = SGLANG_KVPOLL
    else:
        theirs = {k: int(getattr(conn.KVPoll, k)) for k in SGLANG_KVPOLL}
        for ours, base in ((KVSender, conn.BaseKVSender), (KVReceiver, conn.BaseKVReceiver)):
            missing = [m for m in base.__abstractmethods__ if not hasattr(ours, m)]
            assert missing == [], (ours, missing)
        assert hasattr(KVManager, "register_to_bootstrap")
    assert {p.name: int(p) for p in KVPoll} == theirs
    assert [int(s) for s in State] == [int(p) for p in KVPoll]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)])
def test_chunked_prefill_lands_byte_exact_across_tp_sizes(src_tp: int, dst_tp: int) -> None:
    """Three requests admitted at once, prefilled two pages a step, the Mamba-style state
    slot and aux row with the last chunk; prefill TP 2 -> decode TP 1 reaches both prefill
    ranks through the group address, 1 -> 2 slices KV heads and recurrent state (the shard
    groups of seed 003). The short-conv state regions are empty (seed 000): dropped once."""
    with world(src_tp, dst_tp) as w:
        assert all(m.session.manifest.dropped_keys for m in w.pre + w.dec)
        reqs = [
            Req(11, [0, 1, 2, 3, 4], [20, 3, 9, 10, 11], 1, 4, 0),
            Req(12, [7], [0], 2, 0, 1, chunk=1),
            Req(13, [8, 9, 10, 11, 12, 13, 14], [1, 2, 4, 5, 6, 7, 8], 3, 1, 2, chunk=3),
        ]
        sched = Schedulers(w, reqs)
        for r in reqs:
            sched.admit(r)
        seen: dict[int, set[KVPoll]] = {r.room: set() for r in reqs}

        def during(r: Req) -> None:
            seen[r.room].update(s.poll() for s in r.senders)

        sched.run(hook=during)
        assert all(r.decode_end is KVPoll.Success for r in reqs), [r.decode_error for r in reqs]
        assert all(r.prefill_end is KVPoll.Success for r in reqs), [r.prefill_error for r in reqs]
        for i in range(dst_tp):
            w.ref.check(i, _slots(reqs))
        assert all(KVPoll.Bootstrapping not in s for s in seen.values())  # prefill never waits
        metric = reqs[2].senders[0].get_transfer_metric()
        assert metric.transfer_total_bytes and metric.transfer_latency_s is not None


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)])
def test_a_decode_prefix_hit_receives_only_the_pages_after_it(src_tp: int, dst_tp: int) -> None:
    """The decode's radix cache holds a prompt's first pages (``decode_prefix_len``, whole
    pages): it allocates and names only the rest, while the prefill sends every page as
    usual, a chunk straddling the prefix included. The reference checks every decode byte:
    the pages after the prefix hold the prompt's pages after it (not its first ones), and
    the cached pages (slots never named) keep theirs. A full hit names no page and
    still gets its aux row and state. Before ``skip``, any prefix was refused."""
    with world(src_tp, dst_tp, page_size=PAGE) as w:
        reqs = [
            Req(21, [0, 1, 2, 3, 4, 7, 8], [20, 3, 9, 10, 11], 1, 4, 0, chunk=3, prefix=2),
            Req(22, [9, 10, 11], [13], 2, 0, 1, chunk=2, prefix=2),
            Req(23, [14, 15], [], 3, 1, 2, chunk=1, prefix=2),  # the whole prompt is cached
        ]
        sched = Schedulers(w, reqs)
        for r in reqs:
            sched.admit(r)
        sched.run()
        assert all(r.decode_end is KVPoll.Success for r in reqs), [r.decode_error for r in reqs]
        assert all(r.prefill_end is KVPoll.Success for r in reqs), [r.prefill_error for r in reqs]
        for i in range(dst_tp):
            w.ref.check(i, _slots(reqs))


def test_a_prefix_not_made_of_whole_pages_is_refused_naming_it() -> None:
    with world(1, 1, page_size=PAGE) as w:
        recv = KVReceiver(w.dec[0], w.addr, 31)
        for bad, message in ((PAGE + 1, "17 is not a multiple of page_size 16"),
                             (-PAGE, "non-negative int"), (1.5, "non-negative int")):  # fmt: skip
            with pytest.raises(xk.ArgumentError, match=message):
                recv.send_metadata([1], 0, [0], decode_prefix_len=bad)  # type: ignore[arg-type]
        recv.send_metadata([1], 0, [0], decode_prefix_len=0)  # nothing held: the slots as named
        recv.abort()


@pytest.fixture(scope="module")
def scatter() -> Iterator[World]:
    """Prefill TP 1 -> decode TP 2, shared by the examples of the property test below."""
    with world(1, 2) as w:
        yield w


ROOMS = iter(range(1000, 10**6))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    chunk=st.integers(1, 4),
    order=st.permutations(range(SLOTS["kv"])),
    back=st.permutations(range(SLOTS["kv"])),
    states=st.permutations(range(SLOTS["state"])),
)
def test_any_chunking_of_concurrent_requests_lands_exact(
    scatter: World,
    lengths: list[int],
    chunk: int,
    order: list[int],
    back: list[int],
    states: list[int],
) -> None:
    """Concurrent requests of any length, prefilled in chunks of any size, each on pages
    in any order: every decode rank holds exactly the reference bytes in the named rows."""
    w, reqs, at = scatter, [], 0
    for k, n in enumerate(lengths):
        src, dst = order[at : at + n], back[at : at + n]
        reqs.append(Req(next(ROOMS), src, dst, states[k], states[-1 - k], k, chunk=chunk))
        at += n
    sched = Schedulers(w, reqs)
    for r in reqs:
        sched.admit(r)
    sched.run()
    assert all(r.decode_end is r.prefill_end is KVPoll.Success for r in reqs)
    slots = _slots(reqs)
    for i, rank in enumerate(w.ref.dsts):
        want = w.ref.expected(i, slots)
        for key, arr in rank.arrays.items():
            rows = slots[key[0]][1]
            assert np.array_equal(arr[rows], want[key][rows]), (key, i)


def test_an_aborted_request_never_writes_into_its_reused_slots() -> None:
    """The decode aborts a request after naming its pages, frees them only on the group's
    Failed and reuses them at once (a marker written over them); the prefill keeps computing
    and sending that request's chunks. Nothing lands in the reused pages, the prefill's
    sender reports Failed naming the abort, and the next request to the same prefill is
    served (a failure fails its request only: no blacklist, seed 000)."""
    with world(1, 2) as w:
        doomed = Req(21, list(range(0, 8)), list(range(8, 16)), 1, 2, 0, chunk=1)
        other = Req(22, [10, 11], [0, 1], 2, 3, 1)
        sched = Schedulers(w, [doomed, other])
        for r in (doomed, other):
            sched.admit(r)
        while doomed.sent < 2:  # two chunks of eight on their way
            sched.step()
            time.sleep(0.002)
        doomed.receivers[0].abort()  # the scheduler aborts it (a client disconnect, say)
        reused = False
        marker = 0x5A

        def reuse(r: Req) -> None:
            nonlocal reused
            if r is doomed and r.decode_end is KVPoll.Failed and not reused:
                reused = True
                for rank in w.ref.dsts:
                    for key, arr in rank.arrays.items():
                        pool = {"kv": r.dst_kv, "state": [r.dst_state], "aux": [r.aux]}[key[0]]
                        arr[pool] = marker

        sched.run(hook=reuse)
        assert doomed.decode_end is KVPoll.Failed and doomed.prefill_end is KVPoll.Failed
        assert "abort" in doomed.decode_error and "abort" in doomed.prefill_error
        time.sleep(0.3)  # time for anything late to land
        for rank in w.ref.dsts:
            for key, arr in rank.arrays.items():
                pool = {"kv": doomed.dst_kv, "state": [doomed.dst_state], "aux": [doomed.aux]}
                assert (arr[pool[key[0]]] == marker).all(), key
        assert other.decode_end is KVPoll.Success and other.prefill_end is KVPoll.Success
        after = Req(23, [12], [20], 3, 4, 2)
        sched.reqs.append(after)
        sched.admit(after)
        sched.run()
        assert after.decode_end is KVPoll.Success
        for i in range(2):  # the ones that succeeded landed exact, the rest is the marker
            expected = w.ref.expected(i, _slots([other, after]))
            for key, arr in w.ref.dsts[i].arrays.items():
                keep = np.ones(arr.shape[0], bool)
                keep[{"kv": doomed.dst_kv, "state": [2], "aux": [0]}[key[0]]] = False
                assert np.array_equal(arr[keep], expected[key][keep]), key


def test_the_group_frees_nothing_while_one_rank_still_drains() -> None:
    """sglang's MIN over raw polls says Failed as soon as one rank is: the other rank may
    still be receiving into the shared pages. Here only decode rank 0 aborts; the group
    verdict is not Failed until every rank is terminal, and rank 1 is aborted by the
    verdict itself so it drains and gets there. (The group's roster is known first: on
    first contact an abort during the roster lookup reaches no prefill rank, and the
    prefill's sender waits out its deadline; see the abort-before-metadata test.)"""
    with world(1, 2) as w:
        warm = Req(30, [5], [6], 1, 1, 1)
        sched = Schedulers(w, [warm])
        sched.admit(warm)
        sched.run()
        r = Req(31, [0, 1, 2], [3, 4, 5], 0, 0, 0)
        sched = Schedulers(w, [r])
        sched.admit(r)
        sched.step()  # metadata named on both decode ranks, chunk one sent
        assert r.allocated
        r.receivers[0].abort()
        limit = time.monotonic() + 20
        while group_poll([[x] for x in r.receivers])[0] != KVPoll.Failed:
            assert time.monotonic() < limit
            time.sleep(0.002)
        # The verdict said Failed: every rank is FAILED (states never move back), so no
        # byte of the request can land in the shared pages any more.
        assert all(x.poll() is KVPoll.Failed for x in r.receivers)
        assert any(x.reports_root_cause for x in r.receivers)
        with pytest.raises(RequestError, match="abort"):
            r.receivers[1].failure_exception()
        send = r.senders[0]
        deadline = time.monotonic() + 10
        while send.poll() is not KVPoll.Failed:
            assert time.monotonic() < deadline
            time.sleep(0.005)


def _until_failed(pollers: Sequence[KVSender | KVReceiver], within: float) -> None:
    deadline = time.monotonic() + within
    while any(p.poll() is not KVPoll.Failed for p in pollers):
        assert time.monotonic() < deadline, [p.poll() for p in pollers]
        time.sleep(0.005)


def test_an_abort_before_the_metadata_fails_both_sides() -> None:
    """A decode request aborted before it named its pages (sglang: a client gone while the
    request waits for decode memory). Once the group's roster is known to the decode rank,
    the prefill's sender fails at once with the decode's text; on first contact the
    roster lookup is still under way and the Session tells no prefill rank, so the sender
    fails only at its deadline (request_timeout_s), as sglang's bootstrap timeout does."""
    with world(1, 1, request_timeout_s=2.0) as w:
        cold_send = KVSender(w.pre[0], None, 40)
        cold = KVReceiver(w.dec[0], w.addr, 40)
        assert cold.poll() is KVPoll.Bootstrapping
        cold.init(0)
        assert cold.poll() is KVPoll.WaitingForInput
        assert cold_send.poll() is KVPoll.WaitingForInput
        cold.abort()
        _until_failed([cold], 1.0)
        r = Req(41, [0], [1], 0, 0, 0)  # a request that goes through: the roster is known
        sched = Schedulers(w, [r])
        sched.admit(r)
        sched.run()
        assert r.decode_end is KVPoll.Success
        send = KVSender(w.pre[0], None, 42)
        recv = KVReceiver(w.dec[0], w.addr, 42)
        recv.init(0)
        recv.abort()
        _until_failed([send, recv], 10.0)  # the abort's text, not the deadline's (below)
        for p in (send, recv):
            with pytest.raises(RequestError, match="abort"):
                p.failure_exception()
        with pytest.raises(xk.XferError, match="abort"):
            recv.send_metadata([1])
        _until_failed([cold_send], 2.0 + 3.0)
        with pytest.raises(RequestError, match=r"timeout|abort"):
            cold_send.failure_exception()


def test_a_closed_prefill_fails_the_decode_naming_it() -> None:
    with world(1, 1) as w:
        r = Req(51, [0, 1, 2, 3], [4, 5, 6, 7], 0, 0, 0, chunk=1)
        sched = Schedulers(w, [r])
        sched.admit(r)
        sched.step()  # the decode names its pages, the prefill inits and sends chunk one
        assert r.allocated and r.sent == 1
        limit = time.monotonic() + 10
        while r.receivers[0].poll() is not KVPoll.Transferring:  # chunk one landed
            assert time.monotonic() < limit
            time.sleep(0.002)
        where = w.pre[0].session.address
        w.pre[0].close(5)  # the prefill instance goes away mid-request
        limit = time.monotonic() + 15
        while r.decode_end is None:
            assert time.monotonic() < limit
            polls = group_poll([[r.receivers[0]]])
            sched._decode(r, KVPoll(polls[0]))
            time.sleep(0.005)
        assert r.decode_end is KVPoll.Failed
        assert "closed" in r.decode_error and where in r.decode_error, r.decode_error


def test_poll_and_all_reduce_takes_the_engines_collective() -> None:
    """Two decode ranks in threads, their collective a barrier that reduces with MIN: the
    shape of ``torch.distributed.all_reduce(..., op=MIN)`` on a CPU group, in place."""
    with world(1, 2) as w:
        rooms = [61, 62]
        sends = [KVSender(w.pre[0], None, room) for room in rooms]
        recvs = [[KVReceiver(m, w.addr, room) for room in rooms] for m in w.dec]
        barrier, parts = threading.Barrier(2, timeout=10), [np.zeros(0)] * 2

        def member(i: int) -> Callable[[np.ndarray], None]:
            def all_reduce_min(rows: np.ndarray) -> None:  # in place, returns None
                parts[i] = rows.copy()
                barrier.wait()
                rows[...] = group.reduce(parts)
                barrier.wait()

            return all_reduce_min

        results: list[list[list[int]]] = [[], []]

        def rank(i: int) -> None:
            for k, recv in enumerate(recvs[i]):
                recv.init(0)
                recv.send_metadata([k * 2, k * 2 + 1], k, [k])
            while True:
                polls = poll_and_all_reduce(recvs[i], member(i))
                results[i].append(polls)
                if all(p in (0, 4) for p in polls):
                    return
                time.sleep(0.002)

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for k, s in enumerate(sends):
            s.init(2, k)
            s.send(np.array([k * 2 + 6, k * 2 + 7]), [k + 2])
        for t in threads:
            t.join(20)
        assert results[0] == results[1] and results[0][-1] == [4, 4]
        slots = {"kv": ([6, 7, 8, 9], [0, 1, 2, 3]), "state": ([2, 3], [0, 1]),
                 "aux": ([0, 1], [0, 1])}  # fmt: skip
        for i in range(2):
            w.ref.check(i, slots)


def test_misuse_is_named() -> None:
    with world(1, 1) as w:
        send = KVSender(w.pre[0], None, 71)
        with pytest.raises(xk.ArgumentError, match="before init"):
            send.send([0])
        send.init(3, 0)
        with pytest.raises(xk.ArgumentError, match="last chunk only"):
            send.send([0], [1])
        with pytest.raises(xk.ArgumentError, match="past num_kv_indices"):
            send.send([0, 1, 2, 3])
        with pytest.raises(xk.XferError, match="has not failed"):
            send.failure_exception()
        with pytest.raises(xk.ArgumentError, match="prefill KVManager"):
            KVSender(w.dec[0], None, 72)
        with pytest.raises(xk.ArgumentError, match="decode KVManager"):
            KVReceiver(w.pre[0], w.addr, 72)
        recv = KVReceiver(w.dec[0], w.addr, 73)
        with pytest.raises(xk.ArgumentError, match="needs the page size"):
            recv.send_metadata([1], 0, [0], decode_prefix_len=16)
        with xk.open_backend("loopback") as b, pytest.raises(xk.ArgumentError, match="page_size"):
            KVManager(b, w.ref.dsts[0].manifest, "decode", page_size=0)
        with pytest.raises(xk.ArgumentError, match="DP rank"):
            recv.init(1)
        # Before: an index past int64 raised numpy's OverflowError (found by the test below).
        with pytest.raises(xk.ArgumentError, match="aux_index"):
            recv.send_metadata([], 2**63, None)
        with pytest.raises(xk.ArgumentError, match="aux_index"):
            KVSender(w.pre[0], None, 74).init(1, 2**63)
        with xk.open_backend("loopback") as b, pytest.raises(xk.ArgumentError, match="pool"):
            KVManager(b, w.ref.srcs[0].manifest, "prefill", aux_pool="x")


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.integers(-3, 30), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
    st.builds(lambda n: np.arange(n), st.integers(0, 4)),
    st.builds(lambda: np.zeros((2, 2), dtype=np.float32)),
    st.builds(object),
)


def _refused(make: Callable[[xk.Backend], KVManager]) -> None:
    """``make`` over a fresh backend, closed again: a refused manager owns nothing."""
    with xk.open_backend("loopback") as b:
        make(b).close()


@pytest.fixture(scope="module")
def pair() -> Iterator[World]:
    with world(1, 1) as w:
        yield w


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=anything, y=anything, z=anything)
def test_any_argument_succeeds_or_raises_an_xfer_error(pair: World, x: Any, y: Any, z: Any) -> None:
    w = pair
    calls: list[Callable[[], object]] = [
        lambda: KVSender(x, None, 1),
        lambda: KVReceiver(w.dec[0], x, 1),
        lambda: KVManager(x, w.ref.srcs[0].manifest, "prefill"),
        lambda: _refused(lambda b: KVManager(b, x, "prefill")),
        lambda: _refused(lambda b: KVManager(b, w.ref.srcs[0].manifest, x)),
        lambda: _refused(lambda b: KVManager(b, w.ref.srcs[0].manifest, "prefill", bootstrap=x)),
        lambda: _refused(lambda b: KVManager(b, w.ref.srcs[0].manifest, "decode", kv_pool=x)),
        lambda: _refused(lambda b: KVManager(b, w.ref.srcs[0].manifest, "decode", state_pool=x)),
        lambda: _refused(lambda b: KVManager(b, w.ref.srcs[0].manifest, "decode", page_size=x)),
        lambda: summarize(x),
        lambda: verdicts(x, y, z),
        lambda: poll_and_all_reduce(x, lambda rows: rows),
        lambda: poll_and_all_reduce([], x),
        lambda: verdicts([], x, y),
    ]
    for call in calls:
        with contextlib.suppress(xk.XferError):
            call()
    room = f"h{time.monotonic_ns()}"
    send = KVSender(w.pre[0], None, room)
    for call in (lambda: send.init(x, y), lambda: send.init(2), lambda: send.send(x, y)):
        with contextlib.suppress(xk.XferError):
            call()
    recv = KVReceiver(w.dec[0], w.addr, room)
    for call in (
        lambda: recv.init(x),
        lambda: recv.send_metadata(x, y, z),
        lambda: recv.send_metadata([1], 0, None, x),
    ):
        with contextlib.suppress(xk.XferError):
            call()
    send.abort()
    recv.abort()
