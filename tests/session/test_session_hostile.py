"""A hostile peer against honest ranks (issue 17): every rank its own process, real ZMQ.

The attacker (``attacker.py``) is the test process speaking the wire protocol
by hand: it says Hello with valid-looking endpoints, forges Abort and Fail for
ids it never claimed, re-sends what a Welcome told it, and poses as a prefill
rank. Each test runs an honest request past it and checks the bytes; each failed
before the control plane was rebuilt as a protocol core (issue 17).
"""

from __future__ import annotations

import os
import signal

import pytest
import zmq
from attacker import envelope, forge_endpoint, hostile
from session_rank import (
    Check,
    Expect,
    Fill,
    Offer,
    RankProcess,
    Setup,
    Verify,
    Wait,
    Write,
    past_handshake,
    ranks,
)

from xferkit.session import wire

FAST = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 3.0}
FORGED = "forged by the attacker"


def _pair() -> tuple[Setup, Setup]:
    return Setup("src", 0, 1, 1, session=FAST), Setup("dst", 0, 1, 1, session=FAST)


def _honest(
    pre: RankProcess,
    dec: RankProcess,
    rid: str,
    src: list[int],
    dst: list[int],
    before: tuple[list[int], list[int]] = ([], []),
) -> None:
    """One honest request end to end: DONE on both sides, the bytes exact (with those of the
    requests ``before`` it, which the check also expects in place)."""
    dec.ok(Expect(rid, [pre.address], {"kv": dst}))
    pre.ok(Offer(rid))
    pre.ok(Write(rid, {"kv": src}, last=True))
    got = dec.ok(Wait(rid, 5))
    assert got.state == "DONE", got
    assert pre.ok(Wait(rid, 5)).state == "DONE"
    dec.ok(Check({"kv": (before[0] + src, before[1] + dst)}))


# -- 1, 2: Abort and Fail from a connection that never claimed the request ----------------


@pytest.mark.parametrize("forge", ["abort", "fail"])
def test_a_third_partys_abort_or_fail_cannot_touch_another_pairs_request(forge: str) -> None:
    """Defect: any connection that said Hello could Abort (or Fail) any request id on a
    prefill rank; the honest pair's request then failed on both sides with the forged text.
    Fixed: a message acts only on what its own connection claimed, so the honest request
    completes DONE byte-exact on both sides (the Abort is still answered with AbortAck)."""
    with ranks(*_pair()) as (pre, dec), hostile() as a:
        conn = a.connect(pre.address)
        welcome = conn.hello()
        assert welcome is not None and not welcome.error, welcome
        dec.ok(Expect("r", [pre.address], {"kv": [4, 5]}))
        pre.ok(Offer("r"))
        assert past_handshake(dec, "r") == "WAITING"  # its Requests are sent
        for gen in range(1, 21):  # whatever generation the honest rank gave it
            (conn.abort if forge == "abort" else conn.fail)("r", gen, FORGED)
        if forge == "abort":
            assert conn.next(wire.AbortAck) is not None
        assert conn.sync()
        pre.ok(Write("r", {"kv": [0, 1]}, last=True))
        got = dec.ok(Wait("r", 5))
        assert got.state == "DONE", got
        assert pre.ok(Wait("r", 5)).state == "DONE"
        dec.ok(Check({"kv": ([0, 1], [4, 5])}))


@pytest.mark.parametrize("forge", ["abort", "fail"])
def test_a_fail_for_an_id_not_offered_yet_does_not_poison_the_offer(forge: str) -> None:
    """Defect: a Fail (or Abort) for an id no connection had claimed was remembered as the
    request's root cause, and the later offer() failed with the forged text (and so did the
    honest decode rank's request). Fixed: a bare Fail/Abort for an id that connection never
    claimed is dropped (an Abort answered with AbortAck); offer + write + expect end DONE."""
    with ranks(*_pair()) as (pre, dec), hostile() as a:
        conn = a.connect(pre.address)
        welcome = conn.hello()
        assert welcome is not None and not welcome.error, welcome
        (conn.abort if forge == "abort" else conn.fail)("r", 1, FORGED)
        assert conn.sync()
        _honest(pre, dec, "r", [0, 1], [4, 5])


# -- 3: an unrelated prefill rank's Fail on the decode side -------------------------------


def test_a_prefill_rank_the_request_never_named_cannot_fail_it() -> None:
    """Defect: a prefill rank the decode rank had a pair with (because another request named
    it) could fail any decode request by guessing its generation: Fail(rid, gen=1..20) was
    applied from whichever pair it came. Fixed: a Fail (AbortAck, Written, completion) is
    applied only from a source the request named; the honest request completes."""
    with ranks(*_pair()) as (pre, dec), hostile("src") as a:
        fake = a.listen()
        dec.ok(Expect("decoy", [fake.address], {"kv": [9]}))
        got = fake.next(wire.Hello)
        assert got is not None
        ident, _ = got
        fake.welcome(ident, address=fake.address)
        assert fake.next(wire.Request) is not None  # the pair is up: the decoy was asked for
        dec.ok(Expect("r", [pre.address], {"kv": [4, 5]}))
        pre.ok(Offer("r"))
        assert past_handshake(dec, "r") == "WAITING"  # its Requests are sent
        for gen in range(1, 21):
            fake.fail(ident, "r", gen, FORGED)
        assert dec.ok(Wait("r", 0.3)).state == "WAITING", "the forged Fail was applied"
        pre.ok(Write("r", {"kv": [0, 1]}, last=True))
        got_r = dec.ok(Wait("r", 5))
        assert got_r.state == "DONE", got_r
        dec.ok(Check({"kv": ([0, 1], [4, 5])}))


# -- 4: a Hello carrying the prefill's own endpoint ------------------------------------


def test_a_hello_with_the_prefills_own_endpoint_is_refused_and_writes_nothing() -> None:
    """Defect: every Welcome carries the prefill's manifest and endpoint; a raw peer sent them
    back in a Hello, claimed a request id first with a Request naming slots 10 and 11, and the
    prefill copied its own pages 0 and 1 over its pages 10 and 11, reporting DONE. Fixed: an
    endpoint names only the memory of the peer that sent it, so that Hello is refused (a
    Welcome with an error), nothing is written, the prefill's pages 10 and 11 still hold
    their own bytes, and the honest decode rank's requests (the same id among them) work."""
    with ranks(*_pair()) as (pre, dec), hostile() as a:
        first = a.connect(pre.address).hello()
        assert first is not None and not first.error, first
        conn = a.connect(pre.address)
        mirror = conn.hello(
            manifest=first.manifest,
            endpoint=first.endpoint,
            driver_address=first.driver_address,
            tp_rank=first.tp_rank,
            tp_size=first.tp_size,
        )
        assert mirror is not None
        conn.request("x", {"kv": [10, 11]}, registration=envelope(first.endpoint)["generation"])
        conn.sync(timeout=1)  # a refused pair may not answer
        dec.ok(Expect("x", [pre.address], {"kv": [4, 5]}))
        pre.ok(Offer("x"))
        pre.ok(Write("x", {"kv": [0, 1]}, last=True))
        x_dec, x_pre = dec.ok(Wait("x", 5)), pre.ok(Wait("x", 5))
        # The prefill's pages 10 and 11, read through an honest request: its own bytes.
        _honest(pre, dec, "y", [10, 11], [6, 7], before=([0, 1], [4, 5]))
        assert mirror.error, "a Hello naming the prefill's own memory was welcomed"
        assert x_dec.state == "DONE" and x_pre.state == "DONE", (x_dec, x_pre)
        dec.ok(Check({"kv": ([0, 1, 10, 11], [4, 5, 6, 7])}))


# -- 5: a Hello carrying another live decode rank's driver address -------------------------


def test_a_hello_with_another_decode_ranks_driver_address_does_not_retire_its_link() -> None:
    """Defect: a Hello carrying an honest, live decode rank's driver address with a changed
    endpoint blob made the prefill's backend retire that rank's link (it read as a restart),
    and every later honest request on that pair failed as "stale". Fixed: a Hello whose
    endpoint names another live pair's driver address is refused; later honest requests
    succeed."""
    with ranks(*_pair()) as (pre, dec), hostile("src") as a:
        _honest(pre, dec, "r1", [0, 1], [4, 5])
        # The decode rank's endpoint, as any prefill rank it says Hello to learns it.
        fake = a.listen()
        dec.ok(Expect("decoy", [fake.address], {"kv": [9]}))
        got = fake.next(wire.Hello)
        assert got is not None
        ident, hello = got
        fake.welcome(ident, address=fake.address, error="go away", stage="handshake")
        env = envelope(hello.endpoint)
        changed = forge_endpoint(hello.endpoint, generation=env["generation"] + 1)
        conn = a.connect(pre.address)
        reply = conn.hello(
            manifest=hello.manifest,
            endpoint=changed,
            driver_address=hello.driver_address,
            address="tcp://impostor",
        )
        assert reply is not None
        dec.ok(Expect("r2", [pre.address], {"kv": [6, 7]}))
        pre.ok(Offer("r2"))
        pre.ok(Write("r2", {"kv": [2, 3]}, last=True))
        got_r2 = dec.ok(Wait("r2", 5))
        assert got_r2.state == "DONE", got_r2
        assert pre.ok(Wait("r2", 5)).state == "DONE"
        dec.ok(Check({"kv": ([0, 1, 2, 3], [4, 5, 6, 7])}))
        assert reply.error, "a Hello naming another live pair's driver was welcomed"


# -- 6: a fake prefill whose Welcome names an honest prefill's driver -------------------


def test_a_welcome_with_an_honest_prefills_driver_address_steals_nothing() -> None:
    """Defect: a fake prefill whose Welcome named an honest prefill's driver address took over
    the decode rank's driver -> pair map: the honest prefill's completions were credited to
    the fake and dropped, so its requests timed out, even after the fake was gone. Fixed: a
    decode rank refuses a Welcome naming a driver address another live pair holds; the honest
    prefill's requests complete, before and after the fake leaves."""
    with ranks(*_pair()) as (pre, dec), hostile("src") as a:
        _honest(pre, dec, "r1", [0, 1], [4, 5])
        learned = a.connect(pre.address).hello()  # any peer learns the driver address
        assert learned is not None and not learned.error
        fake = a.listen()
        dec.ok(Expect("decoy", [fake.address], {"kv": [9]}))
        got = fake.next(wire.Hello)
        assert got is not None
        fake.welcome(got[0], address=fake.address, driver_address=learned.driver_address)
        fake.next(wire.Request, timeout=0.5)
        dec.ok(Expect("r2", [pre.address], {"kv": [6, 7]}))
        pre.ok(Offer("r2"))
        pre.ok(Write("r2", {"kv": [2, 3]}, last=True))
        got_r2 = dec.ok(Wait("r2", 3))
        assert got_r2.state == "DONE", got_r2
        fake.close()  # the fake goes; the decode rank loses it within dead_after_s
        assert dec.ok(Wait("decoy", 3)).state == "FAILED"
        _honest(pre, dec, "r3", [8, 9], [10, 11], before=([0, 1, 2, 3], [4, 5, 6, 7]))


# -- 8: a prefill paused past dead_after_s ----------------------------------------------


def test_a_prefill_paused_past_dead_after_never_writes_into_reused_slots() -> None:
    """Defect: a prefill stopped (SIGSTOP) past dead_after_s was declared lost, its decode
    request failed, and the engine reused the slots; at SIGCONT the prefill wrote the chunk
    the engine had handed it meanwhile into them and reported DONE. Fixed: once the decode's
    Receive reports FAILED no byte lands in its slots (the engine's reuse survives the
    SIGCONT), and the prefill's Send ends FAILED, never DONE. (The prefill's own dead_after_s
    is longer than the pause, as when each engine picks its own: it does not lose the decode
    rank at SIGCONT before it writes.)"""
    patient = {**FAST, "dead_after_s": 5.0}
    with ranks(Setup("src", 0, 1, 1, session=patient), _pair()[1]) as (pre, dec):
        dec.ok(Expect("r", [pre.address], {"kv": [4, 5]}))
        pre.ok(Offer("r"))
        assert past_handshake(dec, "r") == "WAITING"  # its Requests are sent
        os.kill(pre.proc.pid, signal.SIGSTOP)
        try:
            pre.send(Write("r", {"kv": [0, 1]}, last=True))  # handled at SIGCONT
            lost = dec.ok(Wait("r", 3 * FAST["dead_after_s"]))
            reused = lost.state == "FAILED"
            if reused:  # the engine may reuse the slots now: it does
                dec.ok(Fill({"kv": [4, 5]}, 7))
        finally:
            os.kill(pre.proc.pid, signal.SIGCONT)
        assert pre.reply().ok
        sent = pre.ok(Wait("r", 5))
        got = dec.ok(Wait("r", 5))
        assert got.state == "FAILED", got
        if not reused:
            dec.ok(Fill({"kv": [4, 5]}, 7))
        landed = dec.ask(Verify({"kv": [4, 5]}, 7))
        assert landed.ok, f"bytes landed after the Receive reported FAILED: {landed.error}"
        assert sent.state == "FAILED", f"the prefill reported {sent.state} after the decode failed"


# -- 13: the group roster -----------------------------------------------------------------

ROSTER = {"heartbeat_s": 1.0}  # members re-Join once a second


def test_the_roster_refuses_a_rank_beyond_the_tp_size() -> None:
    """Defect: a Join with tp_rank >= tp_size was accepted, and completed a roster of TP 2 with
    rank 1 missing (decode ranks then resolved the group to a rank that cannot exist). Fixed:
    the Joined reply carries an error and a Lookup's roster does not list it."""
    with ranks(Setup("src", 0, 2, 1, session=ROSTER)) as (server,), hostile("src") as a:
        conn = a.connect(server.address)
        beyond = conn.join(5, 2, address="tcp://127.0.0.1:9|beyond")
        roster = conn.lookup()
        assert beyond is not None and roster is not None
        listed = [m.address for m in roster.ranks]
        assert listed == [server.address], listed
        assert beyond.error, "a Join as TP rank 5 of 2 was accepted"


def test_the_roster_refuses_another_identity_in_a_live_members_place() -> None:
    """Defect: a Join for the place (TP rank, PP stage) of a live member, from another
    identity (address, incarnation), replaced it: the next Lookup sent decode ranks to the
    impostor. Fixed: refused while the member is live (the Joined reply carries an error);
    a Lookup's roster still lists the member and not the impostor."""
    with ranks(Setup("src", 0, 2, 1, session=ROSTER)) as (server,), hostile("src") as a:
        conn = a.connect(server.address)
        with ranks(Setup("src", 1, 2, 1, group=server.address, session=ROSTER)) as (member,):
            for _ in range(100):  # it joins within a heartbeat
                roster = conn.lookup()
                assert roster is not None
                if member.address in [m.address for m in roster.ranks]:
                    break
                conn.next(wire.Roster, timeout=0.05)  # a bounded pause
            else:
                raise AssertionError("the honest member never joined")
            taken = conn.join(1, 2, address="tcp://127.0.0.1:9|taken")
            roster = conn.lookup()
            assert taken is not None and roster is not None
            listed = [m.address for m in roster.ranks]
            assert listed == [server.address, member.address], listed
            assert taken.error, "a live member's place was taken by another identity"


# -- 14: refused keys ---------------------------------------------------------------------


def _key() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def test_a_decode_rank_whose_key_is_refused_is_told_so_quickly() -> None:
    """Defect: with keys, a decode rank whose key the prefill does not trust waited out
    handshake_timeout_s (10 s) and read "no handshake reply". Fixed: it fails within 2 s, with
    a text saying its key was refused."""
    server, stranger = _key(), _key()
    pre_keys = (*server, [server[0]])
    dec_keys = (*stranger, [stranger[0], server[0]])  # it trusts the server; not vice versa
    slow = {"heartbeat_s": 0.2, "dead_after_s": 1.0, "handshake_timeout_s": 10.0}
    with ranks(
        Setup("src", 0, 1, 1, keys=pre_keys, session=slow),
        Setup("dst", 0, 1, 1, keys=dec_keys, session=slow),
    ) as (pre, dec):
        dec.ok(Expect("r", [pre.address], {"kv": [1]}))
        got = dec.ok(Wait("r", 2.0))
        assert got.state == "FAILED", got
        assert got.stage == "handshake" and "key" in got.error and "refused" in got.error, got


@pytest.mark.parametrize("keyed", ["session", "address"])
def test_a_key_mismatch_says_which_side_has_the_key(keyed: str) -> None:
    """Defect: the text for a keyless session given a keyed address said the address had *no*
    key (and the reverse case said the opposite too). Fixed: the text says which side carries
    a key and which has none."""
    public, secret = _key()
    keys = (public, secret, [public])
    if keyed == "address":  # a keyless decode rank, a keyed prefill address
        setups = (
            Setup("src", 0, 1, 1, keys=keys, session=FAST),
            Setup("dst", 0, 1, 1, session=FAST),
        )
    else:
        setups = (
            Setup("src", 0, 1, 1, session=FAST),
            Setup("dst", 0, 1, 1, keys=keys, session=FAST),
        )
    with ranks(*setups) as (pre, dec):
        dec.ok(Expect("r", [pre.address], {"kv": [1]}))
        got = dec.ok(Wait("r", 2.0))
        assert got.state == "FAILED" and got.stage == "handshake", got
        text = got.error
        if keyed == "address":
            assert "has a Curve key" in text and "this session has no keys" in text, text
        else:
            assert "has no Curve key" in text and "this session has keys" in text, text
