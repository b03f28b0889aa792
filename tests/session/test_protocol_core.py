"""The protocol core driven by hand: two cores, no sockets, no threads, no clock.

Each test is one of the Session's invariants (docs/protocol.md, who may send
what): what a message may act on, what an endpoint may name, when FAILED is
said, what a peer can make the core hold. The property test at the end lets
hypothesis interleave engine commands, deliveries, driver completions, time and
a third identity's forged messages, and checks the invariants after every step.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from core_harness import SLOTS, Handle, Net, Write, endpoint
from core_harness import settings as core_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit.manifest import STAGING_POOL
from xferkit.session import wire
from xferkit.session.actions import Send
from xferkit.session.core import MAX_PAIRS, MAX_UNOFFERED_SLOTS
from xferkit.session.fences import REFENCE_S
from xferkit.session.protocol import Protocol
from xferkit.session.states import State
from xferkit.testing import Reference, gdn_hybrid


def _hello(net: Net, address: str, driver: str, **over: object) -> wire.Hello:
    fields = {**net.dec.s.hello(), "address": address, "endpoint": endpoint(driver), **over}
    return wire.Hello(**fields)  # type: ignore[arg-type]


def _welcomes(net: Net, ident: bytes) -> list[wire.Welcome]:
    return [m for i, m in net.to_others if i == ident and isinstance(m, wire.Welcome)]


def test_a_request_goes_to_done_on_both_sides() -> None:
    net = Net()
    net.handshake()
    assert net.finished == {"pre": ["warm"], "dec": ["warm"]}
    assert [c.key for c in net.connects] == [b"D"]  # connected once the Hello was accepted


def test_a_third_identitys_abort_and_fail_touch_nothing_it_did_not_claim() -> None:
    """Before: any connection that said Hello could abort any request id, and a Fail for an
    id not offered yet failed a later offer() with the forged text."""
    net = Net()
    net.handshake()
    net.inject(b"X", _hello(net, "tcp://x", "x-drv"))
    net.inject(b"X", wire.Fail(rid="early", gen=1, stage="abort", text="forged early"))
    net.expect("r", {"kv": [1, 2]})
    net.deliver()
    net.inject(b"X", wire.Abort(rid="r", gen=1, stage="abort", text="forged"))
    net.inject(b"X", wire.Fail(rid="r", gen=2, stage="abort", text="forged"))
    assert (b"X", wire.AbortAck(rid="r", gen=1)) in net.to_others  # nothing of it goes to X
    for rid in ("r", "early"):
        net.offer(rid)
    net.write("r", {"kv": [3, 4]}, last=True)
    net.finish_all()
    net.deliver()
    assert net.handles["dec", "r"].state is State.DONE
    assert net.handles["pre", "r"].state is State.DONE
    assert net.handles["pre", "early"].error is None  # the forged early Fail was dropped


def test_a_sources_fail_counts_only_for_requests_that_named_it() -> None:
    """Before: an unrelated prefill rank's Fail, with a guessed generation, failed a decode
    request it was no source of."""
    net = Net()
    net.handshake()
    net.expect("r", {"kv": [1]})
    net.deliver()
    gen = net.dec.incoming.recvs["r"].gen
    other = net.dec.pairs.open_up("Q", net.now)  # a second prefill rank the decode knows
    assert other is not None
    net.dec.out.take()
    net.apply(
        "dec",
        net.dec.receive(
            other.conn, wire.Fail(rid="r", gen=gen, stage="transfer", text="forged"), net.now
        ),
    )
    assert net.handles["dec", "r"].failing is None
    net.offer("r")
    net.write("r", {"kv": [2]}, last=True)
    net.finish_all()
    net.deliver()
    assert net.handles["dec", "r"].state is State.DONE


def test_a_hello_naming_this_ranks_own_or_a_live_pairs_endpoint_is_refused() -> None:
    """Before: a raw peer re-sent the prefill's own endpoint in a Hello and the prefill copied
    its own pages over its own pages; a Hello with another decode rank's driver address and a
    changed blob retired that rank's link."""
    net = Net()
    net.handshake()
    net.inject(b"X", _hello(net, "tcp://x", "p-drv"))  # the prefill's own driver address
    net.inject(b"Y", _hello(net, "tcp://y", "d-drv"))  # the honest decode rank's
    for ident, who in ((b"X", "this rank's own memory"), (b"Y", "the memory of decode rank 0")):
        (welcome,) = _welcomes(net, ident)
        assert welcome.stage == "handshake" and who in welcome.error, welcome.error
    assert [c.key for c in net.connects] == [b"D"]  # neither reached the backend
    request = wire.Request(
        rid="x", gen=1, needed=True, slots=wire.pack_slots({"kv": [10, 11]}), registration=1
    )
    net.inject(b"X", request)
    net.offer("x")
    net.write("x", {"kv": [0, 1]}, last=True)
    assert not net.writes  # nothing is posted for the refused pair
    net.expect("r", {"kv": [5]})  # and the honest pair still works
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [6]}, last=True)
    net.finish_all()
    net.deliver()
    assert net.handles["dec", "r"].state is State.DONE


def test_a_hello_naming_this_ranks_endpoint_after_a_fence_is_refused() -> None:
    """A rank whose driver fenced (a decode role) has a new driver address, which its Welcomes
    now carry: a Hello naming it is its own memory as much as the first one was."""
    net = Net(fencing=True, fence_cuts_all=True)
    net.handshake()
    net.apply("pre", net.pre.fenced("loopback:p-drv", "", endpoint("p-drv2"), net.now))
    net.inject(b"X", _hello(net, "tcp://x", "p-drv2"))
    (welcome,) = _welcomes(net, b"X")
    assert welcome.stage == "handshake" and "this rank's own memory" in welcome.error, welcome
    assert [c.key for c in net.connects] == [b"D"]


def _starve(net: Net) -> None:
    """The prefill's answers stop reaching the decode rank (a busy machine holds its Pongs) while
    both run and the prefill hears the decode's Pings: the decode declares the pair lost."""
    while "P" in net.dec.pairs.ups:
        while net.to_pre:  # the Pings of the last step
            ident, msg = net.to_pre.popleft()
            net.apply("pre", net.pre.receive(("down", ident), msg, net.now))
        net.to_dec.clear()
        net.now += 0.05
        net.apply("pre", net.pre.timer(net.now))
        net.apply("dec", net.dec.timer(net.now))
    net.to_pre.clear()  # the decode's Bye, on the old connection, is still queued


def _next_hello(net: Net) -> wire.Hello:
    (hello,) = [m for _, m in net.to_pre if isinstance(m, wire.Hello)]
    net.to_pre.clear()
    return hello


def test_a_decode_rank_reconnecting_after_it_lost_the_pair_is_welcomed_again() -> None:
    """Before: a decode rank that declared a starved prefill lost came back on a new connection
    and was refused ("names the memory of decode rank 0") while the prefill still held the old
    pair, so its next request failed at handshake (seen under load, 1 request of 400)."""
    net = Net()
    net.handshake()
    _starve(net)
    net.now += net.dec.s.reconnect_max_s + 1  # past the backoff
    net.expect("r", {"kv": [1]})
    net.inject(b"D2", _next_hello(net))  # a new DEALER: a new identity
    (welcome,) = _welcomes(net, b"D2")
    assert welcome.error == "", welcome.error
    assert list(net.pre.pairs.downs) == [b"D2"]  # the old pair is retired, not kept beside it
    assert [c.key for c in net.connects] == [b"D", b"D2"]


def test_pairs_coming_up_failing_and_lost_are_told_once_each() -> None:
    """What ``Session(on_pair=...)`` sees: each handshake's end on both sides, a refused
    Hello, and a working pair lost, each once."""
    net = Net()
    net.handshake()
    assert sorted(net.paired) == [("decode", "P", "up"), ("prefill", "D", "up")]
    net.inject(b"X", _hello(net, "tcp://x", "p-drv"))  # refused: names the prefill's memory
    assert net.paired[-1] == ("prefill", "tcp://x", "failed")
    del net.paired[:]
    _starve(net)
    assert net.paired == [("decode", "P", "lost")]


def test_a_hello_copying_a_pairs_place_without_its_resume_digest_is_refused() -> None:
    """What lets the same rank back in keeps another out: its address, incarnation and driver
    address are no secret (Pings and the roster carry them), the resume digest is."""
    net = Net()
    net.handshake()
    honest = net.pre.pairs.downs[b"D"]
    for resume in (b"", b"\x00" * 16):
        forged = wire.Hello(
            **{**msgspec.structs.asdict(_hello(net, "D", "d-drv")), "resume": resume}
        )
        net.inject(b"F", forged)
        (welcome, *_) = _welcomes(net, b"F")
        assert "the memory of decode rank 0" in welcome.error, welcome.error
        net.to_others.clear()
    assert net.pre.pairs.downs[b"D"] is honest and list(net.pre.pairs.downs) == [b"D"]


def test_a_welcome_naming_a_driver_address_a_live_pair_holds_is_refused() -> None:
    """Before: a fake prefill whose Welcome named an honest prefill's driver address stole its
    completions."""
    net = Net()
    net.handshake()
    up = net.dec.pairs.open_up("Q", net.now)
    assert up is not None
    net.dec.out.take()
    fake = wire.Welcome(**{**net.pre.s.hello(), "address": "Q"})  # type: ignore[arg-type]
    net.apply("dec", net.dec.receive(up.conn, fake, net.now))
    assert "Q" not in net.dec.pairs.ups and net.dec.pairs.by_driver["loopback:p-drv"].address == "P"


def _abort_while_writing(net: Net) -> tuple[Handle, Write]:
    """Request ``r``, aborted by its decode rank while its one write is in the driver."""
    net.handshake()
    recv = net.expect("r", {"kv": [1, 2]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=True)
    (write,) = net.writes.values()
    net.abort("dec", "r")
    net.deliver()
    return recv, write


def test_failed_is_said_only_once_the_source_confirmed_nothing_is_in_flight() -> None:
    """Before: the decode rank stopped waiting for the AbortAck after dead_after_s and said
    FAILED while the prefill was still draining; bytes landed after FAILED."""
    net = Net()
    recv, write = _abort_while_writing(net)
    assert recv.failing is not None and recv.state is not State.FAILED
    assert write.cancelled
    net.advance(net.dec.s.dead_after_s + 1)  # the prefill pongs: it is alive, still draining
    net.deliver()
    assert recv.state is not State.FAILED
    net.finish(write.wid)
    net.deliver()
    assert recv.state is State.FAILED and recv.error is not None and recv.error.stage == "abort"
    assert net.failed_with_writes == []
    assert str(net.handles["pre", "r"].error) == str(recv.error)


def _aborted_mid_write(net: Net) -> tuple[Handle, wire.Ended]:
    """A request aborted by its decode rank while its write was in the driver, the driver
    having let go of it since (its queued bytes may still go out): the ``Ended`` posted."""
    recv, write = _abort_while_writing(net)
    assert write.cancelled
    net.finish(write.wid)
    ended = wire.Ended("r", net.dec.incoming.recvs["r"].gen)
    assert [wire.decode_note(w.note) for w in net.writes.values() if w.note] == [ended]
    return recv, ended


def test_where_ends_are_not_final_failed_waits_for_the_ended_notification() -> None:
    """A driver whose released writes still land (NIXL over UCX's TCP transport): the source
    posts ``Ended`` behind them and says so in its ``AbortAck``; the decode rank says FAILED
    once ``Ended`` landed, not at the ``AbortAck`` (where bytes still arrived: 64 MB of a
    160 MiB write in tests/session/test_session_ended.py). An ``Ended`` of another
    generation or request settles nothing."""
    net = Net(ends_are_final=False)
    recv, ended = _aborted_mid_write(net)
    assert ("P", wire.AbortAck(rid="r", gen=ended.gen, barrier=True)) in net.to_dec
    net.deliver()
    assert recv.failing is not None and recv.state is not State.FAILED
    net.advance(net.dec.s.dead_after_s + 1)  # the pair is alive: nothing else settles it
    for stray in (wire.Ended("r", ended.gen + 1), wire.Ended("other", ended.gen)):
        net.apply("dec", net.dec.notification("loopback:p-drv", wire.encode(stray), net.now))
    assert recv.state is not State.FAILED  # another generation's, another request's: nothing
    net.finish_all()  # the Ended lands, after the bytes
    assert recv.state is State.FAILED and recv.error is not None and recv.error.stage == "abort"


def test_an_ended_notification_before_its_abortack_counts() -> None:
    """``Ended`` travels on the data path, the ``AbortAck`` on the control socket: either may
    come first."""
    net = Net(ends_are_final=False)
    recv, _ = _aborted_mid_write(net)
    (end,) = net.writes
    net.finish(end)  # the Ended lands first
    assert recv.state is not State.FAILED  # the source's AbortAck is still on its way
    net.deliver()
    assert recv.state is State.FAILED


def test_where_ends_are_final_nothing_follows_the_abortack() -> None:
    """The loopback's, Mooncake's: the AbortAck is the proof, and no notification is posted."""
    net = Net()
    recv, _ = _abort_while_writing(net)
    net.finish_all()
    assert recv.state is State.FAILED and not net.writes
    assert all(w.note is None or isinstance(wire.decode_note(w.note), wire.Tag) for w in net.ended)


def test_a_decode_rank_that_said_bye_still_gets_the_abortack_it_waits_for() -> None:
    """Before (CI, tests/session's paused-prefill test): a decode rank lost its prefill, sent
    Abort then Bye; the resumed prefill had posted the engine's chunk first, so the write was
    still in the driver when the Bye marked the rank lost, and once it ended the AbortAck was
    skipped for a lost rank. The decode request drained to the prefill's drain bound (71 s)
    instead of failing at once."""
    net = Net()
    net.handshake()
    recv = net.expect("r", {"kv": [1, 2]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=True)  # posted before the prefill reads its socket
    (write,) = net.writes.values()
    net.abort("dec", "r")
    net.apply("dec", net.dec.timer(net.now))
    bye = wire.Bye(incarnation=net.dec.s.incarnation, reason="lost")
    net.to_pre.append((b"D", bye))  # the decode rank's Bye, behind its Abort
    net.deliver()
    assert write.cancelled and recv.state is not State.FAILED
    net.finish(write.wid)
    net.deliver()
    assert recv.state is State.FAILED and net.failed_with_writes == []


def _closed_at_done(net: Net, last: bool) -> tuple[Handle, Handle, int]:
    """The decode rank is told its write landed (the notification, after the data) before
    the prefill's driver says the write ended; the decode engine closes at once: its Bye
    reaches the prefill with the write still in the prefill's driver."""
    net.handshake()
    recv = net.expect("r", {"kv": [1, 2]})
    net.deliver()
    send = net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=last)
    (write,) = net.writes.values()
    if last:
        assert write.note is not None
        net.apply("dec", net.dec.notification("loopback:p-drv", write.note, net.now))
        assert recv.state is State.DONE
    net.to_pre.append((b"D", wire.Bye(incarnation=net.dec.s.incarnation, reason="closed")))
    net.deliver()
    return recv, send, write.wid


def test_a_decode_rank_closing_at_done_leaves_the_prefill_done() -> None:
    """Before: the Bye failed the prefill's request (peer lost) although every byte had
    landed and the decode rank said DONE (21 of 30 runs of two Sessions closing at DONE)."""
    net = Net()
    recv, send, wid = _closed_at_done(net, last=True)
    assert send.state is not State.FAILED and send.failing is None
    net.apply("pre", net.pre.write_ended(wid, "", net.now))
    assert send.state is State.DONE and recv.state is State.DONE


def test_a_bye_with_the_last_write_failing_still_fails_the_prefill() -> None:
    net = Net()
    _, send, wid = _closed_at_done(net, last=True)
    net.apply("pre", net.pre.write_ended(wid, "connection reset", net.now))
    assert send.state is State.FAILED and send.error is not None
    assert send.error.stage == "transfer" and "connection reset" in str(send.error)


def test_a_bye_before_the_last_chunk_fails_the_prefill_at_once() -> None:
    """More was to be written: nothing the decode rank could still take."""
    net = Net()
    _, send, _ = _closed_at_done(net, last=False)
    assert send.failing is not None and send.failing.stage == "peer lost"
    assert "closed its session" in str(send.failing)


def _silent_source(net: Net) -> Handle:
    """A request whose source goes silent with its write in the driver, until it is lost."""
    net.handshake()
    recv = net.expect("r", {"kv": [1]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [2]}, last=True)
    net.to_dec.clear()  # from here on the prefill is silent: nothing reaches the decode rank
    while recv.failing is None and net.now < 3 * net.dec.s.dead_after_s:
        net.now += 0.05
        net.apply("dec", net.dec.timer(net.now))
        net.to_pre.clear()
    assert recv.failing is not None and recv.failing.stage == "peer lost"
    return recv


def test_a_silent_source_keeps_the_slots_out_of_reuse_until_its_drain_bound() -> None:
    """A prefill rank that stops answering (paused, partitioned) may still write: the decode
    request drains until the bound derived from the source's own deadlines."""
    net = Net()
    recv = _silent_source(net)
    lost_at = net.now
    while recv.state is not State.FAILED and net.now < lost_at + 60:
        net.now += 0.05
        net.apply("dec", net.dec.timer(net.now))
    assert net.now - lost_at >= net.dec.s.drain_s  # not before the source's own drain bound
    assert net.fences == []  # the loopback cannot fence


def test_a_driver_that_fences_ends_a_lost_sources_request_once_fenced() -> None:
    """With a fencing driver the decode rank asks it to cut the lost source's connections and
    says FAILED once it did, not after the source's drain bound; not before it either."""
    net = Net(fencing=True)
    recv = _silent_source(net)
    assert net.fences == ["loopback:p-drv"]
    net.now += 1.0
    net.apply("dec", net.dec.timer(net.now))
    assert recv.state is not State.FAILED  # the fence is not done yet
    net.apply("dec", net.dec.fenced("loopback:p-drv", "", b"new", net.now))
    assert recv.state is State.FAILED and recv.error is not None
    assert recv.error.stage == "peer lost"


def test_a_fence_that_fails_leaves_the_request_draining_to_its_bound() -> None:
    """A fence that keeps failing (a NIC or link down) is asked for again every REFENCE_S
    while the request waits, and the request drains to its bound meanwhile."""
    net = Net(fencing=True)
    recv = _silent_source(net)
    lost_at, asked = net.now, 0
    while recv.state is not State.FAILED and net.now < lost_at + 60:
        while net.fences:
            net.fences.pop()
            asked += 1
            net.apply("dec", net.dec.fenced("loopback:p-drv", "the NIC said no", b"", net.now))
        net.now += 0.05
        net.apply("dec", net.dec.timer(net.now))
    assert net.now - lost_at >= net.dec.s.drain_s
    assert asked >= net.dec.s.drain_s / REFENCE_S - 1  # asked again every REFENCE_S
    for _ in range(60):
        net.now += 0.05
        net.apply("dec", net.dec.timer(net.now))
    assert net.fences == []  # and not once the request ended


def test_a_fence_that_failed_is_asked_again_and_ends_the_request_once_it_holds() -> None:
    """Before: one failed fence (NIXL cannot start its new agent while the host's link is
    down) left the request draining to its bound, 15 s in the fault matrix's cut."""
    net = Net(fencing=True)
    recv = _silent_source(net)
    assert net.fences == ["loopback:p-drv"]
    net.fences.clear()
    net.apply("dec", net.dec.fenced("loopback:p-drv", "the link is down", b"", net.now))
    assert net.fences == [] and recv.state is not State.FAILED
    net.now += REFENCE_S
    net.apply("dec", net.dec.timer(net.now))
    assert net.fences == ["loopback:p-drv"]  # asked again
    net.apply("dec", net.dec.fenced("loopback:p-drv", "", b"new", net.now))
    assert recv.state is State.FAILED


def test_a_closed_connection_is_fenced_too_where_the_driver_can() -> None:
    """A killed prefill's kernel still delivers what its sockets held (tests/hosts measured a
    megabyte on Mooncake after the connection closed): a fencing driver cuts it."""
    net = Net(fencing=True)
    net.handshake()
    recv = net.expect("r", {"kv": [1]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [2]}, last=True)
    net.apply("dec", net.dec.disconnected(net.dec_conn, net.now))
    assert net.fences == ["loopback:p-drv"] and recv.state is not State.FAILED
    net.apply("dec", net.dec.fenced("loopback:p-drv", "", b"new", net.now))
    assert recv.state is State.FAILED


def test_a_paused_prefill_writes_nothing_more_to_its_decode_ranks() -> None:
    """Before: a prefill paused past dead_after_s was declared lost, and when it resumed it
    wrote the engine's next chunk into slots the decode rank had reused, reporting DONE."""
    net = Net()
    net.handshake()
    net.expect("r", {"kv": [1, 2]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3]}, last=False)
    net.finish_all()
    net.deliver()
    net.now += net.pre.s.dead_after_s + 1  # SIGSTOP ... SIGCONT
    net.write("r", {"kv": [4]}, last=True)
    assert not net.writes  # nothing posted after the pause
    send = net.handles["pre", "r"]
    assert send.state is State.FAILED and send.error is not None
    assert "paused" in str(send.error)


def test_requests_nobody_offered_are_held_within_their_bound() -> None:
    """Before: Requests for ids nobody offered were kept whole as int64 arrays (1.6 GiB)."""
    net = Net()
    net.handshake()
    big = wire.pack_slots({"kv": list(range(64)) * (MAX_UNOFFERED_SLOTS // 64 // 2)})
    for i in itertools.count():
        msg = wire.Request(rid=f"big{i}", gen=i + 10, needed=True, slots=big, registration=1)
        net.to_dec.clear()
        net.apply("pre", net.pre.receive(("down", b"D"), msg, net.now))
        if any(isinstance(m, wire.Fail) for _, m in net.to_dec):
            break
        assert i < 4
    assert net.pre.outgoing.ledger.held <= MAX_UNOFFERED_SLOTS
    (fail,) = [m for _, m in net.to_dec if isinstance(m, wire.Fail)]
    assert "MAX_UNOFFERED_SLOTS" in fail.text


def test_hellos_beyond_the_pair_cap_are_refused_and_keep_nothing() -> None:
    net = Net()
    for i in range(MAX_PAIRS + 5):
        net.inject(b"h%d" % i, _hello(net, f"tcp://h{i}", f"h{i}-drv"))
    assert len(net.pre.pairs.downs) == MAX_PAIRS and len(net.connects) == MAX_PAIRS
    (last,) = _welcomes(net, b"h%d" % (MAX_PAIRS + 4))
    assert "MAX_PAIRS" in last.error


def test_the_roster_admits_only_what_fits_the_group() -> None:
    """Before: a Join with tp_rank >= tp_size completed a roster with a rank missing, and a
    live member's place could be taken by another identity."""
    ref = Reference(gdn_hybrid(), src_tp=2, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    core = Protocol(core_settings("P", ref.srcs[0].manifest, "p-drv"))
    now = 0.0

    def join(ident: bytes, tp_rank: int) -> str:
        msg = wire.Join(
            incarnation=7, address=f"tcp://{ident.decode()}", tp_rank=tp_rank, tp_size=2,
            pp_rank=0, pp_size=1,
        )  # fmt: skip
        (reply,) = [a.msg for a in core.receive(("down", ident), msg, now) if isinstance(a, Send)]
        assert isinstance(reply, wire.Joined)
        return reply.error

    assert "TP rank 2" in join(b"a", 2)  # outside the group
    assert join(b"a", 1) == ""
    assert "which tcp://a holds" in join(b"b", 1)  # a live member's place
    assert join(b"a", 1) == ""  # the member itself, again
    now += core.s.dead_after_s + 1
    assert join(b"b", 1) == ""  # once the member is gone


def _forward(states: list[State]) -> bool:
    """States only move forward, and nothing follows a terminal one."""
    ends = [i for i, s in enumerate(states) if s in (State.DONE, State.FAILED)]
    live = states[: ends[0]] if ends else states
    return (not ends or ends == [len(states) - 1]) and live == sorted(live)


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "expect",
                "offer",
                "write",
                "last",
                "abort_dec",
                "abort_pre",
                "deliver",
                "finish",
                "fail_write",
                "time",
                "forge",
            ]
        ),
        st.integers(0, 2),  # request
        st.integers(0, 5),  # forged message kind
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_interleavings_with_a_forger_keep_the_invariants(ops: list[tuple[str, int, int]]) -> None:
    net = Net(request_timeout_s=5.0, lease_s=3.0, drain_s=2.0)
    net.handshake()
    net.inject(b"X", _hello(net, "tcp://x", "x-drv"))
    rids = [f"r{k}" for k in range(3)]
    claimed: set[str] = set()
    for op, k, kind in ops:
        rid = rids[k]
        dec, pre = net.handles.get(("dec", rid)), net.handles.get(("pre", rid))
        if op == "expect" and dec is None:
            net.expect(rid, {"kv": [10 + 2 * k, 11 + 2 * k]})
        elif op == "offer" and pre is None:
            net.offer(rid)
        elif op in ("write", "last") and pre is not None and rid not in net.pre.outgoing.failing:
            rec = net.pre.outgoing.sends.get(rid)
            if rec is not None and not rec.last:
                net.write(
                    rid, {"kv": [20 + k]} if op == "write" else {"kv": [30 + k]}, op == "last"
                )
        elif op == "abort_dec" and dec is not None:
            net.abort("dec", rid)
        elif op == "abort_pre" and pre is not None:
            net.abort("pre", rid)
        elif op == "deliver":
            net.deliver()
        elif op in ("finish", "fail_write") and net.writes:
            net.finish(next(iter(net.writes)), "driver said no" if op == "fail_write" else "")
        elif op == "time":
            net.advance(0.5)
        elif op == "forge":
            gen = net.dec.incoming.recvs[rid].gen if rid in net.dec.incoming.recvs else 1
            forged: list[wire.Message] = [
                wire.Abort(rid=rid, gen=gen, stage="abort", text="forged"),
                wire.Fail(rid=rid, gen=gen, stage="transfer", text="forged"),
                wire.Unpacked(rid=rid, gen=gen, chunk=0, index=0),
                wire.Renew(rids=[rid]),
                wire.Request(
                    rid=rid,
                    gen=gen,
                    needed=True,
                    slots=wire.pack_slots({"kv": [0, 1]}),
                    registration=1,
                ),
                wire.Ping(incarnation=5),
            ]
            net.inject(b"X", forged[kind])
            rec = net.pre.outgoing.sends.get(rid) or net.pre.outgoing.failing.get(rid)
            if rec is not None and any(d.down.ident == b"X" for d in rec.dsts.values()):
                claimed.add(rid)  # first to ask: without keys, any peer may claim an id first
        # Invariants after every step.
        assert net.failed_with_writes == []  # FAILED only once nothing can land
        for (side, r), h in net.handles.items():
            if h.error is not None and r not in claimed:
                assert "forged" not in str(h.error), (side, r, h.error)
            assert _forward(h.states), (side, r, h.states)
        for side in ("pre", "dec"):
            assert len(net.finished[side]) == len(set(net.finished[side]))
        for w in net.writes.values():  # the forger gets writes only of what it claimed
            assert w.peer == ("peer", b"D") or w.rid in claimed, w
    # Whatever happened, every request ends once time passes and messages flow.
    for _ in range(25):
        net.finish_all()
        net.deliver()
        net.advance(1.0)
    for (side, r), h in net.handles.items():
        if side == "dec" or net.handles.get(("dec", r)) is not None:
            assert h.state in (State.DONE, State.FAILED), (side, r, h.states)


# -- what the simulator found (python -m xferkit.testing.sim; docs/reliability.md) ------------


def test_a_refused_pairs_request_cannot_fail_a_place_another_connection_claimed() -> None:
    """Found by the simulator (invariant 7): a connection whose handshake failed sent a
    Request for an id the honest decode rank had claimed, and the prefill failed the whole
    request with that connection's error (then every rank of it, with the forged cause)."""
    net = Net()
    net.handshake()
    recv = net.expect("r", {"kv": [1, 2]})
    net.deliver()  # the honest decode rank claimed its place
    net.offer("r")
    net.inject(b"X", _hello(net, "tcp://x", "x-drv", version=wire.PROTOCOL_VERSION - 1))
    assert _welcomes(net, b"X")[0].error  # refused: its pair keeps the error
    net.inject(b"X", wire.Request(rid="r", gen=recv_gen(net, "r"), needed=True, slots={}))
    replies = [m for i, m in net.to_others if i == b"X" and isinstance(m, wire.Fail)]
    assert [m.rid for m in replies] == ["r"]  # it is told its own pair's error
    send = net.handles["pre", "r"]
    assert send.failing is None and send.state is not State.FAILED
    net.write("r", {"kv": [3, 4]}, last=True)
    net.finish_all()
    net.deliver()
    assert send.state is State.DONE and recv.state is State.DONE


def recv_gen(net: Net, rid: str) -> int:
    return net.dec.incoming.recvs[rid].gen


def test_an_offer_of_an_id_that_failed_here_fails_at_once_with_its_root_cause() -> None:
    """Found by the simulator (invariant 5): an id offered again after it failed here waited
    out its lease ("no decode rank claimed it") while every decode rank asking for it was told
    the earlier root cause; and an id offered again after DONE read a text of another shape
    than the decode ranks'."""
    net = Net()
    net.handshake()
    net.expect("r", {"kv": [1]})
    net.deliver()
    net.offer("r")
    net.abort("dec", "r")
    net.deliver()
    first = net.handles["pre", "r"]
    assert first.state is State.FAILED and first.error is not None
    again = net.offer("r")
    assert again.state is State.FAILED and again.error is not None
    assert str(again.error) == str(first.error)
    reused = net.offer("warm")  # DONE here in the handshake
    net.expect("warm", {"kv": [5]})
    net.deliver()
    told = net.handles["dec", "warm"]
    assert reused.error is not None and told.failing is not None
    assert str(reused.error) == str(told.failing)  # one text on both sides
    assert "was already used with this prefill rank" in str(reused.error)


def test_closing_a_decode_session_says_failed_only_once_its_sources_stopped() -> None:
    """Found by the simulator (invariant 1): close() reported a decode request FAILED at
    once, and a write already in the prefill's driver landed after it. Now it drains like
    any failure, and goodbye (the shell's last step, before the backend deregisters the
    memory) settles whatever is left."""
    net = Net()
    net.handshake()
    recv = net.expect("r", {"kv": [1, 2]})
    late = net.expect("q", {"kv": [3]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=True)
    assert len(net.writes) == 1
    net.apply("dec", net.dec.close("closed by the engine", net.now))
    assert recv.failing is not None and recv.state is not State.FAILED
    assert net.dec.draining()
    net.deliver()
    assert recv.state is not State.FAILED  # the prefill's write is still in its driver
    net.finish_all()
    net.deliver()
    assert recv.state is State.FAILED and net.failed_with_writes == []
    assert late.state is not State.FAILED or late.failing is not None
    net.apply("dec", net.dec.goodbye("closed by the engine"))
    assert not net.dec.draining() and late.state is State.FAILED


def test_a_completion_before_the_request_asked_its_source_is_dropped() -> None:
    """Before (found by the simulator's hostile prefill): a request waiting for staging had
    its sources chosen but not asked; a ``Written`` from one of them counted, and one with
    ``total=1`` made it DONE before any byte was written (or its Request sent)."""
    net = Net(staging_bytes=1 << 14)  # slices of 4 KiB: four requests stage at once
    net.handshake()
    handles = [net.expect(f"r{i}", {"kv": [10 + 2 * i, 11 + 2 * i]}) for i in range(5)]
    net.deliver()
    last = net.dec.incoming.recvs["r4"]
    assert last.started and not last.requested  # waiting for staging: P not asked yet
    forged = wire.Written(rid="r4", gen=last.gen, src_rank=0, seq=0, total=1)
    net.apply("dec", net.dec.receive(net.dec_conn, forged, net.now))
    assert handles[4].states == [State.HANDSHAKING]
    for i in range(5):
        net.offer(f"r{i}")
        net.write(f"r{i}", {"kv": [40 + 2 * i, 41 + 2 * i]}, last=True)
    for _ in range(10):
        net.finish_all()
        net.deliver()
    for h in handles:
        assert h.state is State.DONE
        assert h.states == sorted(h.states)  # forward only: WAITING before TRANSFERRING
        assert State.WAITING in h.states


@pytest.mark.parametrize("polls", [True, False])
def test_a_source_pokes_a_decode_rank_that_polls_its_notifications_as_each_write_ends(
    polls: bool,
) -> None:
    """A decode rank whose driver has no descriptor to wait on (NIXL) read a notification only
    at its next poll, up to ``shell.POLL_S`` later; its Hello now asks for a ``Poke`` as each
    write to it ends, whose arrival wakes it then (one-page NIXL requests: 0.6-0.9 ms sooner).
    Before, no Poke was ever sent. A rank that can wait on its driver asks for none."""
    net = Net(pokes=polls)
    net.handshake()
    h = net.expect("r", {"kv": [1, 2]})
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=True)
    posted = len(net.writes)
    assert posted
    while net.writes:
        net.finish(next(iter(net.writes)))
    pokes = [m for _, m in net.to_dec if isinstance(m, wire.Poke)]
    assert len(pokes) == (posted if polls else 0)
    net.deliver()
    assert h.state is State.DONE and net.handles["pre", "r"].state is State.DONE


def test_a_poke_changes_nothing_on_the_decode_rank() -> None:
    """A Poke only wakes its receiver: a buggy or hostile source sending them at will moves
    no request, counts no write and gets no answer."""
    net = Net(pokes=True)
    net.handshake()
    h = net.expect("r", {"kv": [1, 2]})
    net.deliver()
    before = list(h.states)
    for _ in range(100):
        net.apply("dec", net.dec.receive(net.dec_conn, wire.Poke(), net.now))
    assert h.states == before and not net.to_pre
    net.offer("r")
    net.write("r", {"kv": [3, 4]}, last=True)
    net.finish_all()
    net.deliver()
    assert h.state is State.DONE


@pytest.mark.parametrize("where", ["its kv pool", "past its staging's end"])
def test_staging_offered_outside_the_decode_ranks_staging_is_refused_before_any_write(
    where: str,
) -> None:
    """Before: the prefill rank took the piece a Request named on trust. One inside another
    region the decode rank advertised (its KV pool) passed every bounds check, and staged
    rounds landed in slots a stale or hostile offer never meant to give."""
    net = Net(staging_bytes=1 << 16)
    net.handshake()
    regions = net.dec.s.manifest.regions
    staging = next(r for r in regions if r.pool == STAGING_POOL)
    kv = next(r for r in regions if r.pool == "kv" and r.nbytes >= 4096)
    at = kv.addr if where == "its kv pool" else staging.addr + staging.nbytes - 64
    net.offer("r")
    net.write("r", {"kv": [3]}, last=True)
    net.to_dec.clear()
    msg = wire.Request(
        rid="r", gen=7, needed=True, slots=wire.pack_slots({"kv": [5]}), registration=1,
        staging=at, staging_bytes=4096,
    )  # fmt: skip
    net.inject(b"D", msg)  # on the decode rank's own connection
    assert not [w for w in net.writes.values() if w.rid == "r"]  # nothing posted
    (fail,) = [m for _, m in net.to_dec if isinstance(m, wire.Fail)]
    assert fail.stage == "request" and "not within the staging it advertised" in fail.text


def test_staged_rounds_are_posted_sealed_to_the_pair_and_within_its_staging() -> None:
    """A round's wire copies come sealed to the pair's manifests, as a plan's direct writes do,
    so the backend does not scan them again (8% of a prefill rank's CPU under load). The seal
    covers only what lies in bounds: the source's halves in its own staging, the decode
    rank's in the piece it offered, slots in their pools. Before, rounds went unsealed."""
    net = Net(staging_bytes=1 << 16)
    net.handshake()
    net.expect("r", {"kv": [10, 11], "state": [2]})
    (request,) = [m for _, m in net.to_pre if isinstance(m, wire.Request)]
    net.deliver()
    net.offer("r")
    net.write("r", {"kv": [3, 4], "state": [5]}, last=True)
    notes = {wid: wire.decode_note(w.note) for wid, w in net.writes.items() if w.note}
    rounds = [net.writes[wid] for wid, n in notes.items() if isinstance(n, wire.Tag) and n.round]
    assert rounds and request.staging
    offered = (request.staging, request.staging + request.staging_bytes)
    staging = [r for r in net.dec.s.manifest.regions if r.pool == STAGING_POOL]
    landed = 0  # copies into the decode rank's staging: some must, or the check below is idle
    for w in rounds:
        assert w.descs is not None and w.descs.origin is not None
        mine, theirs = w.descs.origin
        assert mine is net.pre.s.manifest and theirs == net.dec.s.manifest
        assert mine.first_outside(w.descs.src, w.descs.nbytes) == -1
        assert theirs.first_outside(w.descs.dst, w.descs.nbytes) == -1
        for a, n in zip(w.descs.dst.tolist(), w.descs.nbytes.tolist(), strict=True):
            if any(r.addr <= a < r.addr + r.nbytes for r in staging):
                assert offered[0] <= a and a + n <= offered[1]
                landed += 1
    assert landed
