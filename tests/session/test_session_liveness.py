"""A failure one side knows of reaches the other at once, over real sockets.

Sessions in one process over the loopback (and, for a prefill closing mid-handshake, a
raw ROUTER posing as that prefill: a real Session's connect is too quick to close inside
it on purpose). Both defects left a request waiting out a long timeout: the timeouts here
are 30 s, and each failure must be seen in under ``QUICK``. Nothing lands in either case:
the tests check that nothing was written as well.
"""

from __future__ import annotations

import time

import pytest
from attacker import hostile

import xferkit as xk
from xferkit.session import Receive, RequestError, Send, Session, State, wire
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 8, "state": 4}
TIMEOUT_S = 30.0
"""``handshake_timeout_s`` and ``request_timeout_s`` of every Session here."""
QUICK = 5.0
"""Under a sixth of every timeout: a failure seen within it did not wait one out."""


def _session(manifest: xk.Manifest, group: str | None = None) -> Session:
    return Session(
        xk.open_backend("loopback"),
        manifest,
        group=group,
        heartbeat_s=0.2,
        dead_after_s=2.0,
        handshake_timeout_s=TIMEOUT_S,
        request_timeout_s=TIMEOUT_S,
    )


def _failed(handle: Send | Receive, since: float) -> RequestError:
    """``handle``'s root cause, once FAILED within QUICK of ``since``."""
    with pytest.raises(RequestError) as info:
        handle.wait(QUICK)
    assert time.monotonic() - since < QUICK
    assert handle.poll() is State.FAILED
    return info.value


def test_an_abort_during_the_group_lookup_fails_every_prefill_ranks_offer_at_once() -> None:
    """The decode rank names a TP 2 prefill group whose second rank has not joined yet, so
    the roster lookup goes on; the engine aborts the request meanwhile. Once the rank joins,
    both prefill ranks' offers fail with the abort's text (before: each waited out
    request_timeout_s, 30 s, for a Request that never came)."""
    ref = Reference(gdn_hybrid(), src_tp=2, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    first = _session(ref.srcs[0].manifest)
    dec = _session(ref.dsts[0].manifest)
    sessions = [first, dec]
    try:
        sends = [first.offer("r")]
        recv = dec.expect("r", first.group_address, {"kv": [1, 2], "state": [0]})
        time.sleep(0.3)  # the roster says 1 of 2 ranks joined: the decode rank asks again
        assert recv.poll() is State.HANDSHAKING
        recv.abort(timeout=QUICK)  # FAILED at once: nothing was asked, nothing can land
        assert recv.error is not None and recv.error.stage == "abort"
        joined = time.monotonic()
        second = _session(ref.srcs[1].manifest, group=first.address)
        sessions.append(second)
        sends.append(second.offer("r"))
        for send in sends:
            error = _failed(send, joined)
            assert error.stage == "abort" and str(error) == str(recv.error)
        ref.check(0, {})  # nothing was written
    finally:
        for s in sessions:
            s.close()


def test_a_prefill_saying_bye_in_place_of_its_welcome_fails_the_request_at_once() -> None:
    """Two sources: a real prefill Session and a raw ROUTER posing as the other prefill rank,
    which closes while the decode rank's handshake with it is pending: its Bye comes instead
    of a Welcome. The request fails at once (before: after handshake_timeout_s, 30 s, "no
    handshake reply"), naming that rank, and the real prefill's offer with the same text."""
    ref = Reference(gdn_hybrid(), src_tp=2, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = _session(ref.srcs[0].manifest)
    dec = _session(ref.dsts[0].manifest)
    try:
        with hostile("src") as a:
            fake = a.listen()
            send = pre.offer("r")
            recv = dec.expect("r", [pre.address, fake.address], {"kv": [1, 2], "state": [0]})
            got = fake.next(wire.Hello)
            assert got is not None
            said = time.monotonic()
            fake.send(got[0], wire.Bye(incarnation=a.incarnation, reason="closed by the engine"))
            error = _failed(recv, said)
            assert error.stage == "peer lost" and error.peer == fake.address
            assert f"{fake.address} closed its session during the handshake" in str(error)
            assert "closed by the engine" in str(error)
            told = _failed(send, said)
            assert str(told) == str(error)
        ref.check(0, {})
    finally:
        pre.close()
        dec.close()
