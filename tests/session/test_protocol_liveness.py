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
