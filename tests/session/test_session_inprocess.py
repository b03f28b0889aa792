"""Both sides in one process over MockDriver: driver faults and drivers without notifications."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

from xferkit import Backend, Descriptors, Manifest, Status, XferError
from xferkit.driver import BatchWorker, Posted, QueuedBatch
from xferkit.session import RequestError, Session, State, dataplane
from xferkit.testing import Reference, RegionSpec, gdn_hybrid
from xferkit.testing.mock import STALL, Call, MockDriver

SLOTS = {"kv": 8, "state": 4}


def _session(driver: MockDriver, manifest: Manifest) -> Session:
    return Session(Backend(driver), manifest, heartbeat_s=0.2, dead_after_s=2.0)


def _pair(
    driver_src: MockDriver, driver_dst: MockDriver, dst_specs: list[RegionSpec] | None = None
) -> tuple[Reference, Session, Session]:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    dst = ref.dsts[0].manifest
    if dst_specs is not None:
        other = Reference(dst_specs, src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
        dst = other.dsts[0].manifest
        ref.dsts = other.dsts  # keeps that memory alive with the reference
    return ref, _session(driver_src, ref.srcs[0].manifest), _session(driver_dst, dst)


def test_a_driver_failure_is_the_root_cause_on_both_sides() -> None:
    def fail_posts(call: Call) -> str | None:
        return "NIC on fire" if call.op == "post" else None

    _, pre, dec = _pair(MockDriver(fail_posts), MockDriver())
    try:
        recv = dec.expect("r", pre.address, {"kv": [1, 2]})
        send = pre.offer("r")
        send.write({"kv": [3, 4]}, last=True)
        for h in (send, recv):
            with pytest.raises(RequestError, match="NIC on fire"):
                h.wait(5)
        assert send.poll() is State.FAILED and recv.poll() is State.FAILED
        assert send.error is not None and recv.error is not None
        assert send.error.stage == recv.error.stage == "transfer"
        assert "NIC on fire" in str(recv.error) and str(send.error) == str(recv.error)
        assert dec.progress() == ["r"] and pre.progress() == ["r"]
    finally:
        pre.close()
        dec.close()


def test_without_notifications_completion_travels_as_a_control_message() -> None:
    src, dst = MockDriver(notifications=False), MockDriver(notifications=False)
    ref, pre, dec = _pair(src, dst)
    try:
        recv = dec.expect("r", [pre.address], {"kv": [5, 6, 7], "state": [1]})
        send = pre.offer("r")
        send.write({"kv": [0], "state": [2]})
        send.write({"kv": [1, 2]}, last=True)
        assert recv.wait(5) is State.DONE and send.wait(5) is State.DONE
        ref.check(0, {"kv": ([0, 1, 2], [5, 6, 7]), "state": ([2], [1])})
        assert not dst.of("notifications")  # never asked a driver that has none
    finally:
        pre.close()
        dec.close()


def test_a_decode_abort_returns_only_after_the_stalled_write_was_drained() -> None:
    src = MockDriver(lambda call: STALL if call.op == "post" else None)
    ref, pre, dec = _pair(src, MockDriver())
    try:
        recv = dec.expect("r", [pre.address], {"kv": [1, 2]})
        send = pre.offer("r")
        send.write({"kv": [3, 4]}, last=True)
        while send.poll() is not State.TRANSFERRING:
            time.sleep(0.005)
        assert src.handles and src.handles[0].poll() is Status.PENDING
        recv.abort(5)
        # FAILED only once the source released (cancelled) the write that was in flight
        assert recv.poll() is State.FAILED and src.handles[0].released == 1
        assert send.poll() is State.FAILED
        assert recv.error is not None and send.error is not None
        assert recv.error.stage == send.error.stage == "abort"
        assert str(recv.error) == str(send.error)
        ref.check(0, {})  # not one byte landed
        again = dec.expect("r2", [pre.address], {"kv": [1, 2]})  # the slots, reused at once
        assert again.poll() in (State.HANDSHAKING, State.WAITING)
        again.abort(5)
    finally:
        pre.close()
        dec.close()


def test_a_plan_error_reads_the_same_on_both_sides() -> None:
    other = gdn_hybrid(head_dim=8)  # the decode engine runs another head size
    _, pre, dec = _pair(MockDriver(), MockDriver(), dst_specs=other)
    try:
        recv = dec.expect("r", [pre.address], {"kv": [1]})
        send = pre.offer("r")
        for h in (recv, send):
            with pytest.raises(RequestError):
                h.wait(5)
        assert recv.error is not None and send.error is not None
        assert recv.error.stage == send.error.stage == "plan"
        assert str(recv.error) == str(send.error)
        assert "region kv/k" in str(recv.error) and "prefill rank 0" in str(recv.error)
    finally:
        pre.close()
        dec.close()


def test_a_prefill_rank_refuses_a_request_id_it_already_finished() -> None:
    ref, pre, dec = _pair(MockDriver(), MockDriver())
    second = _session(MockDriver(), ref.dsts[0].manifest)
    try:
        recv = dec.expect("r", [pre.address], {"kv": [1]})
        send = pre.offer("r")
        send.write({"kv": [2]}, last=True)
        assert recv.wait(5) is State.DONE
        # Asked while the prefill rank still tracks the request or after it finished: the
        # same refusal (it read "sent request 'r' twice" when the Request won that race).
        late = second.expect("r", [pre.address], {"kv": [3]})
        with pytest.raises(RequestError, match="already used") as info:
            late.wait(5)
        assert info.value.stage == "request"
    finally:
        for s in (pre, dec, second):
            s.close()


def test_session_arguments_are_checked() -> None:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    with pytest.raises(XferError, match="Backend"):
        Session(object(), ref.srcs[0].manifest)  # type: ignore[arg-type]
    with pytest.raises(XferError, match="dead_after_s"):
        Session(Backend(MockDriver()), ref.srcs[0].manifest, heartbeat_s=2, dead_after_s=1)
    s = _session(MockDriver(), ref.srcs[0].manifest)
    try:
        with pytest.raises(XferError, match="unknown pool"):
            s.expect("a", ["tcp://127.0.0.1:1"], {"nope": [1]})
        with pytest.raises(XferError, match="out of range"):
            s.expect("a", ["tcp://127.0.0.1:1"], {"kv": [SLOTS["kv"]]})
        with pytest.raises(XferError, match="twice"):
            s.expect("a", ["tcp://127.0.0.1:1"], {"kv": [1, 1]})
        with pytest.raises(XferError, match="request id"):
            s.offer(7)  # type: ignore[arg-type]
        send = s.offer("b")
        with pytest.raises(XferError, match="out of range"):
            send.write({"kv": [-1]})
        send.write({"kv": [1]}, last=True)
        with pytest.raises(XferError, match="after the last chunk"):
            send.write({"kv": [2]})
    finally:
        s.close()
    with pytest.raises(XferError, match="closed"):
        s.offer("c")


def test_a_driver_that_works_inside_its_post_never_silences_the_heartbeats() -> None:
    """NIXL on host memory copies inside its post call. Before, small posts were made on the
    control thread: a backlog of them delayed the Pongs behind it past dead_after_s and the
    decode rank declared its live prefill rank lost. A post found to take longer than
    ``dataplane.INLINE_S`` sends the next ones to the data-plane worker."""

    def slow_posts(call: Call) -> str | None:
        if call.op == "post":
            time.sleep(0.05)  # the driver moving the bytes (the GIL released, as NIXL does)
        return None

    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    options = {"heartbeat_s": 0.2, "dead_after_s": 1.2}  # a loaded CI machine stalls for 0.6 s
    pre = Session(Backend(MockDriver(slow_posts)), ref.srcs[0].manifest, **options)  # type: ignore[arg-type]
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, **options)  # type: ignore[arg-type]
    try:
        rids = [f"r{i}" for i in range(60)]  # 60 posts of 50 ms: 3 s of driver work
        sends = [pre.offer(rid) for rid in rids]
        for s in sends:
            s.write({"kv": [1]}, last=True)
        recvs = [dec.expect(rid, [pre.address], {"kv": [2]}) for rid in rids]
        for h in recvs + sends:
            with contextlib.suppress(XferError):  # the states below say how each ended
                h.wait(20)
        assert {h.poll() for h in recvs + sends} == {State.DONE}, [
            str(h.error) for h in recvs + sends if h.error
        ][:2]
    finally:
        pre.close()
        dec.close()


def _loaded_machine(monkeypatch: pytest.MonkeyPatch, slow_s: float) -> None:
    """Thresholds a loaded CI machine cannot cross by chance: a quick call is one under 20 ms
    (a preemption took a mock's post past 0.5 ms), and the worker keeps slow calls for
    ``slow_s``. The tests' slow calls take 50 ms."""
    monkeypatch.setattr(dataplane, "INLINE_S", 0.02)
    monkeypatch.setattr(dataplane, "SLOW_S", slow_s)


@pytest.mark.parametrize("slow", [1, 3])
def test_only_posts_slow_in_a_row_go_to_the_data_plane_worker(
    slow: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver slow inside its post (``slow`` posts of 50 ms) sends the next posts to the
    worker for a while only when ``dataplane.SLOW_POSTS`` in a row were slow. Before, one slow
    post (a preemption, a garbage collection) did: measured on the loopback, a third of the
    one-page posts of bench_session.py took the worker's extra hop."""
    _loaded_machine(monkeypatch, slow_s=5.0)
    threads: list[str] = []

    def record(call: Call) -> str | None:
        if call.op == "post":
            threads.append(threading.current_thread().name)
            if call.count <= slow:
                time.sleep(0.05)
        return None

    _, pre, dec = _pair(MockDriver(record), MockDriver())
    try:
        for i in range(6):  # one at a time: nothing queued for the worker ahead of a post
            recv = dec.expect(f"r{i}", pre.address, {"kv": [1]})
            send = pre.offer(f"r{i}")
            send.write({"kv": [2]}, last=True)
            assert recv.wait(10) is State.DONE and send.wait(10) is State.DONE
    finally:
        pre.close()
        dec.close()
    where = ["worker" if t.startswith("xferkit-data-") else "inline" for t in threads]
    assert where == ["inline"] * 6 if slow == 1 else ["inline"] * 3 + ["worker"] * 3, threads


class _Seen(QueuedBatch):
    """A batch that records which thread polled it and what it read."""

    def __init__(self, descs: Descriptors | None, notify: bytes | None, link: str) -> None:
        super().__init__(descs, notify)
        self.link = link
        self.polls: list[tuple[str, Status]] = []

    def poll(self) -> Status:
        st = super().poll()
        self.polls.append((threading.current_thread().name, st))
        return st


class _Waking(MockDriver):
    """The mock's copies on a worker thread of its own, whose batches wake their poller
    (``Posted.on_end``, as the loopback's and Mooncake's do); the first ``slow`` posts take
    50 ms inside the call."""

    def __init__(self, slow: int = 0) -> None:
        super().__init__()
        self.slow = slow
        self.batches: list[_Seen] = []
        self._worker: BatchWorker[_Seen] = BatchWorker(self._run, "test-waking")

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        if len(self.batches) < self.slow:
            time.sleep(0.05)
        batch = _Seen(descs, notify, link)
        self.batches.append(batch)
        self._worker.post(batch)
        return batch

    def _run(self, batch: _Seen) -> str | None:
        done = self._fate("post", batch.link, batch.descs, batch.notify)
        return None if done.poll() is Status.DONE else done.error

    def close(self) -> None:
        self._worker.stop()
        super().close()


@pytest.mark.parametrize("slow", [0, 4])
def test_a_write_whose_driver_wakes_us_is_polled_on_the_control_thread(
    slow: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When its driver says a write ended, the control thread polls it (such a poll reads a
    status): before, the data-plane worker was woken to poll it and report, two thread
    hand-overs per write, a twelfth of bench_session.py's pipelined one-page rate. A driver
    whose calls turn slow (``dataplane.SLOW_POSTS`` in a row) has the worker poll them."""
    # The worker's deadline check polls a write older than CHECK_S too: on a loaded CI
    # machine one took that long to reach the control thread and the check read its DONE.
    monkeypatch.setattr(dataplane, "CHECK_S", 30.0)
    _loaded_machine(monkeypatch, slow_s=2.0)
    driver = _Waking(slow)
    _, pre, dec = _pair(driver, MockDriver())

    def one(i: int) -> None:
        recv = dec.expect(f"r{i}", pre.address, {"kv": [1]})
        send = pre.offer(f"r{i}")
        send.write({"kv": [2]}, last=True)
        assert recv.wait(10) is State.DONE and send.wait(10) is State.DONE

    try:
        for i in range(6):
            one(i)
        if slow:  # once SLOW_S passed, the control thread polls them again
            time.sleep(dataplane.SLOW_S + 0.1)
            one(6)
            one(7)
    finally:
        pre.close()
        dec.close()
    assert len(driver.batches) == (8 if slow else 6)
    for batch in driver.batches[6:]:
        assert {name.split("-")[1] for name, st in batch.polls if st is Status.DONE} == {
            "session"
        }, batch.polls
    for n, batch in enumerate(driver.batches[:6]):
        ended = {name.split("-")[1] for name, st in batch.polls if st is Status.DONE}
        # The first post may wait for the worker (behind the Connect): its 50 ms are not
        # counted, so slow inline posts in a row begin with the first or the second.
        if slow and n >= slow:  # posted, and polled, by the worker
            assert ended == {"data"}, (n, batch.polls)
        elif not slow and n:
            assert ended == {"session"}, (n, batch.polls)


class _Deaf(Posted):
    """A batch that cannot say when it ends (no ``on_end``: polled every ``POLL_S``), stalled
    until released."""

    def __init__(self) -> None:
        self.released = False

    def poll(self) -> Status:
        return Status.FAILED if self.released else Status.PENDING

    @property
    def error(self) -> str:
        return "released while stalled"

    def release(self) -> None:
        self.released = True


class _PartlyDeaf(_Waking):
    """``_Waking`` whose first post stalls in a batch that must be polled."""

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        if not self.batches and not getattr(self, "deaf", None):
            self.deaf = _Deaf()
            return self.deaf
        return super().post(link, descs, notify)


def test_writes_that_end_while_the_driver_is_slow_are_polled_when_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the driver's calls are slow the worker polls the writes whose driver said they
    ended. Before, a worker that also had a write to poll every ``POLL_S`` (one its driver
    cannot wake us for) took those ended writes and polled only the other one: they waited
    for their deadline check (``CHECK_S``) and their prefill handles stayed TRANSFERRING
    (measured: 30-55 ms between two 64-request blocks of bench_session.py)."""
    monkeypatch.setattr(dataplane, "CHECK_S", 30.0)  # a deadline check never rescues them
    monkeypatch.setattr(dataplane, "POLL_S", 0.0)  # the stalled write is due at every turn
    driver = _PartlyDeaf(slow=4)
    _, pre, dec = _pair(driver, MockDriver())
    try:
        stuck = dec.expect("stuck", pre.address, {"kv": [1]})
        pre.offer("stuck").write({"kv": [2]}, last=True)
        for i in range(8):  # the first three slow posts send the next ones to the worker
            recv = dec.expect(f"r{i}", pre.address, {"kv": [3 + i % 5]})
            send = pre.offer(f"r{i}")
            send.write({"kv": [3 + i % 5]}, last=True)
            assert recv.wait(10) is State.DONE
            assert send.wait(10) is State.DONE, f"r{i}: {send.poll()}"
        assert stuck.poll() is State.TRANSFERRING or stuck.poll() is State.WAITING
    finally:
        pre.close()
        dec.close()
    assert any(
        name.startswith("xferkit-data-") and st is Status.DONE
        for batch in driver.batches
        for name, st in batch.polls
    ), "no write was polled by the worker: the driver never turned slow"


def test_a_stalled_write_is_not_polled_every_millisecond_when_its_driver_wakes_us(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loopback says when a batch ends (``Posted.on_end``): while its write is stalled
    the data plane polls it only every ``dataplane.CHECK_S`` (its deadline), and the abort's
    end wakes it at once. Before, it polled every 1-4 ms: the GIL taken from the driver's
    threads and the control thread hundreds of times a second per write in flight."""
    import xferkit as xk
    from xferkit.transfer import Transfer
    from xferkit_loopback import Faults

    polls = [0]
    poll = Transfer.poll

    def counted(self: Transfer) -> Status:
        polls[0] += 1
        return poll(self)

    monkeypatch.setattr(Transfer, "poll", counted)
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    stuck = xk.open_backend("loopback", faults=Faults(stall_post_at=1))
    pre = Session(stuck, ref.srcs[0].manifest)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        recv = dec.expect("r", pre.address, {"kv": [2]})
        send = pre.offer("r")
        send.write({"kv": [1]}, last=True)
        limit = time.monotonic() + 10
        while send.poll() is not State.TRANSFERRING:
            assert time.monotonic() < limit, send.poll()
            time.sleep(0.01)
        before = polls[0]
        time.sleep(1.0)  # the write stays in the driver
        stalled = polls[0] - before
        recv.abort(10)
        with pytest.raises(XferError):
            send.wait(10)
        assert send.poll() is State.FAILED and recv.poll() is State.FAILED
    finally:
        pre.close()
        dec.close()
    assert stalled < 100, f"{stalled} polls in 1 s of a stalled write"


def test_a_burst_of_slow_commands_never_silences_the_heartbeats() -> None:
    """Under 200 concurrent requests on a starved CPU, each command took milliseconds and the
    control thread ran the whole burst before it read a Ping again: for seconds no Pong went
    out and decode ranks declared a live prefill rank lost (on NIXL and Mooncake, with the
    two cores kept busy). A pass of the loop now spends at most ``shell.BUDGET_S`` on
    commands before it reads its sockets and runs its timers."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    options = {"heartbeat_s": 0.2, "dead_after_s": 1.2}  # a loaded CI machine stalls for 0.6 s
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest, **options)  # type: ignore[arg-type]
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, **options)  # type: ignore[arg-type]
    try:
        recv = dec.expect("r", [pre.address], {"kv": [2]})
        pre.offer("r").write({"kv": [1]}, last=True)
        assert recv.wait(10) is State.DONE  # the pair is up
        waiting = dec.expect("after", [pre.address], {"kv": [3]})
        core = pre._protocol
        offer = core.offer

        def slow_offer(*args: object) -> object:
            time.sleep(0.005)  # a command that takes 5 ms on a starved CPU
            return offer(*args)  # type: ignore[arg-type]

        core.offer = slow_offer  # type: ignore[method-assign, assignment]
        burst = [pre.offer(f"b{i}") for i in range(600)]  # 3 s of commands, queued at once
        last = pre.offer("after")
        last.write({"kv": [1]}, last=True)
        assert waiting.wait(20) is State.DONE and last.wait(20) is State.DONE
        assert all(h.poll() is State.WAITING for h in burst)  # offered, held for a decode rank
    finally:
        pre.close()
        dec.close()


def test_a_handle_times_each_state_it_went_through() -> None:
    """The per-request timeline an engine can export: when each state was reached."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest)
    try:
        before = time.monotonic()
        recv = dec.expect("r", [pre.address], {"kv": [2]})
        send = pre.offer("r")
        send.write({"kv": [1]}, last=True)
        assert recv.wait(10) is State.DONE and send.wait(10) is State.DONE
        got = recv.times
        assert list(got) == [State.HANDSHAKING, State.WAITING, State.TRANSFERRING, State.DONE]
        assert before <= got[State.HANDSHAKING] <= got[State.WAITING]
        assert got[State.WAITING] <= got[State.TRANSFERRING] <= got[State.DONE] <= time.monotonic()
        assert next(iter(send.times)) is State.WAITING and State.DONE in send.times
        gone = dec.expect("gone", [pre.address], {"kv": [3]})
        gone.abort(10)
        assert State.FAILED in gone.times and State.DONE not in gone.times
    finally:
        pre.close()
        dec.close()
