"""Liveness of the protocol core, driven by hand: a failure reaches every side at once.

Nothing here is about safety (nothing lands in any of these cases): each test is a
request that used to wait out a long timeout on one side, although the other side
already knew it had failed. docs/reliability.md lists them with the defects they fixed.
"""

from __future__ import annotations

from core_harness import Net

from xferkit.session import wire
from xferkit.session.states import State


def _conn(net: Net, address: str) -> tuple:
    return net.dec.pairs.ups[address].conn


def test_an_abort_during_the_group_lookup_fails_the_prefills_offer_once_the_roster_came() -> None:
    """Before: aborted while its group's roster was on its way, a request had no sources to
    tell; the roster came, nothing was sent, and the prefill's Send waited out
    request_timeout_s. Now the claim goes to every rank the roster (and the spec) names."""
    net = Net()
    send = net.offer("r")
    recv = net.expect("r", {"kv": [1, 2]}, sources=("group+P", "Q"))
    net.abort("dec", "r")
    assert recv.state is State.FAILED  # nothing was asked: nothing can land
    assert recv.error is not None and recv.error.stage == "abort"
    net.deliver()  # Lookup -> Roster -> Hello -> Welcome -> the claim
    assert send.state is State.FAILED and send.error is not None
    assert send.error.stage == "abort" and str(send.error) == str(recv.error)
    assert not net.writes and not net.connects[1:]  # one pair, nothing posted
    queued = net.dec.pairs.ups["Q"].queued  # Q has not answered its Hello: told once it does
    assert [(m.rid, m.failed) for m in queued if isinstance(m, wire.Request)] == [
        ("r", str(recv.error))
    ]


def test_a_request_that_failed_during_a_lookup_that_failed_too_opens_no_pair() -> None:
    """The claim is owed only to ranks a roster names: a lookup that expires leaves nothing
    behind (no pair opened, nothing kept)."""
    net = Net(handshake_timeout_s=1.0)
    recv = net.expect("r", {"kv": [1]}, sources=("group+P",))
    net.to_pre.clear()  # the Lookup is lost: no roster ever comes
    net.abort("dec", "r")
    assert recv.state is State.FAILED
    net.advance(1.5)
    assert not net.dec.pairs.ups and not net.dec.incoming.unresolved
    assert not net.dec.roster.groups


def test_a_bye_in_place_of_the_welcome_fails_what_waits_on_that_handshake_at_once() -> None:
    """Before: a prefill closing while it connected to us said Bye instead of Welcome; the
    Bye was dropped ("before its Welcome") and the request failed only after
    handshake_timeout_s with "no handshake reply". Now the Bye ends that handshake."""
    net = Net(handshake_timeout_s=60.0)
    recv = net.expect("r", {"kv": [1]})
    assert isinstance(net.to_pre.popleft()[1], wire.Hello)  # P closes before it answers
    bye = wire.Bye(incarnation=7, reason="closed by the engine")
    net.apply("dec", net.dec.receive(net.dec_conn, bye, net.now))
    assert recv.state is State.FAILED and recv.error is not None
    assert recv.error.stage == "peer lost" and recv.error.peer == "P"
    assert "P closed its session during the handshake: closed by the engine" in str(recv.error)
    assert ("decode", "P", "failed") in net.paired and "P" not in net.dec.pairs.ups


def test_a_bye_ends_only_the_handshake_of_the_connection_it_came_on() -> None:
    """A Bye acts on its connection's pair: Q's Bye fails what waits on Q, never P's
    handshake (nor a request that needs only P); a Bye on a connection that is no pair's is
    dropped. Only the rank bound at Q's address can send on our DEALER to it."""
    net = Net(handshake_timeout_s=60.0)
    on_q = net.expect("q", {"kv": [2]}, sources=("Q",))
    on_p = net.expect("p", {"kv": [1]})
    bye = wire.Bye(incarnation=7, reason="going")
    net.apply("dec", net.dec.receive(("up", "P", 999), bye, net.now))  # no pair's connection
    net.apply("dec", net.dec.receive(_conn(net, "Q"), bye, net.now))
    assert on_q.state is State.FAILED and on_q.error is not None and on_q.error.peer == "Q"
    assert on_p.state is State.HANDSHAKING and on_p.failing is None
    net.deliver()
    net.offer("p")
    net.write("p", {"kv": [5]}, last=True)
    net.finish_all()
    net.deliver()
    assert on_p.state is State.DONE


def test_a_prefill_slow_to_connect_its_driver_does_not_call_the_waiting_decode_rank_silent() -> (
    None
):
    """A decode rank pings only once Welcomed, and the Welcome waits for the prefill's
    driver to connect. Before, the prefill timed the new pair's silence from the Hello: a
    connect that took ``dead_after_s`` (a busy data-plane worker; a lost SYN costs 1 s) lost
    the pair on both sides, "sent nothing for 1.0 s" (a CI run of the hosts fault matrix, the
    request after a cut was mended). Now the connect is bounded by handshake_timeout_s and
    the silence counts from the Welcome."""
    net = Net(hold_connects=True, heartbeat_s=0.2, dead_after_s=1.0, handshake_timeout_s=10.0)
    recv = net.expect("r", {"kv": [1, 2]})
    net.deliver()  # the Hello: the prefill's driver connects ...
    net.advance(3.0)  # ... for three liveness bounds
    assert recv.state is State.HANDSHAKING and recv.failing is None
    assert b"D" in net.pre.pairs.downs
    net.connect(net.connects[0])
    net.deliver()  # the Welcome
    net.advance(0.9)  # just inside dead_after_s of the Welcome, with no Ping through yet
    send = net.offer("r")
    net.write("r", {"kv": [1, 2]}, last=True)
    net.finish_all()
    net.deliver()
    assert recv.state is State.DONE and send.state is State.DONE


def test_a_prefill_whose_driver_never_connects_forgets_the_pair_within_the_handshake_bound() -> (
    None
):
    """Nothing waits without a deadline: a connect that never returns costs the prefill its
    pair after handshake_timeout_s from the Hello (the decode rank gave up then too), however
    often the peer pings meanwhile, and a connect that comes back later is disconnected
    rather than Welcomed."""
    net = Net(hold_connects=True, heartbeat_s=0.2, dead_after_s=1.0, handshake_timeout_s=4.0)
    recv = net.expect("r", {"kv": [1]})
    net.deliver()
    ping = wire.Ping(incarnation=net.dec.s.incarnation)  # as a hostile decode rank would
    for _ in range(13):
        net.advance(0.3)
        net.inject(b"D", ping)
    assert b"D" in net.pre.pairs.downs and recv.state is State.HANDSHAKING  # 3.9 s
    net.advance(0.3)
    net.inject(b"D", ping)
    assert not net.pre.pairs.downs and not net.pre.pairs.down_drivers
    assert recv.state is State.FAILED and recv.error is not None
    assert "no handshake reply" in str(recv.error)
    net.connect(net.connects[0])
    assert not net.to_dec  # no Welcome for a pair forgotten
