"""Session settings from a mapping, a file and ``XFERKIT_*`` variables: what a deployment writes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import zmq.auth

import xferkit as xk
from xferkit.session import Session, SessionConfig, State, load_config
from xferkit.testing import Reference, gdn_hybrid

SLOTS = {"kv": 8, "state": 4}


def test_a_file_with_variables_over_it_gives_every_field_its_type(tmp_path: Path) -> None:
    (tmp_path / "x.toml").write_text(
        'backend = "loopback"\nrequest_timeout_s = 30\nstaging = "never"\n[backend_options]\n'
    )
    env = {
        "XFERKIT_DEAD_AFTER_S": "8",
        "XFERKIT_PP_RANK": "1",
        "XFERKIT_PP_SIZE": "2",
        "XFERKIT_BACKEND_OPTIONS": '{"faults": null}',
        "XFERKIT_TRUSTED_KEYS": os.pathsep.join(["/k/a.key", "/k/dir"]),
        "XFERKIT_GROUP": "",
        "UNRELATED": "1",
    }
    c = load_config(tmp_path / "x.toml", env)
    assert c.request_timeout_s == 30.0 and c.staging == "never"  # from the file
    assert c.dead_after_s == 8.0 and isinstance(c.dead_after_s, float)  # from the variables
    assert (c.pp_rank, c.pp_size) == (1, 2) and c.group is None
    assert c.backend_options == {"faults": None}
    assert c.trusted_keys == ["/k/a.key", "/k/dir"]
    assert c.heartbeat_s == 1.0  # the Session's default
    (tmp_path / "x.json").write_text(json.dumps({"bind": "tcp://127.0.0.1:0", "lease_s": 5}))
    assert load_config(tmp_path / "x.json", {}).lease_s == 5.0
    assert load_config({"lease_s": 7}, {"XFERKIT_LEASE_S": "9"}).lease_s == 9.0
    assert load_config(None, {}) == SessionConfig()


@pytest.mark.parametrize(
    ("source", "env", "named"),
    [
        ({"dead_after_s": "soon"}, {}, "dead_after_s"),
        ({"dead_after": 5}, {}, "dead_after"),  # a misspelt field is refused, not ignored
        ({"staging": "sometimes"}, {}, "staging"),
        ({}, {"XFERKIT_PP_RANK": "one"}, "XFERKIT_PP_RANK"),
        ({}, {"XFERKIT_BACKEND_OPTIONS": "{oops"}, "XFERKIT_BACKEND_OPTIONS"),
        ("/nonexistent/xferkit.toml", {}, "/nonexistent/xferkit.toml"),
        (3, {}, "mapping or a path"),
    ],
)
def test_a_bad_setting_is_an_xfer_error_naming_it(source: object, env: dict, named: str) -> None:
    with pytest.raises(xk.XferError, match=named.replace("/", ".")):
        load_config(source, env)  # type: ignore[arg-type]


def test_sessions_from_config_hand_a_request_over_with_keys(tmp_path: Path) -> None:
    _, secret = zmq.auth.create_certificates(str(tmp_path), "rank")
    config = {"backend": "loopback", "secret_key_file": secret, "staging": "never"}
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    env = {"XFERKIT_REQUEST_TIMEOUT_S": "20"}
    pre = Session.from_config(ref.srcs[0].manifest, config, env=env)
    dec = Session.from_config(ref.dsts[0].manifest, config, env=env)
    try:
        assert pre.keys is not None and pre.request_timeout_s == 20.0
        recv = dec.expect("r", [pre.address], {"kv": [2]})
        pre.offer("r").write({"kv": [1]}, last=True)
        assert recv.wait(10) is State.DONE
        ref.check(0, {"kv": ([1], [2])})
    finally:
        pre.close()
        dec.close()


def test_a_refused_config_leaves_no_backend_open() -> None:
    """The Session refuses the ranges (dead_after_s under heartbeat_s): the backend the
    config opened is closed again, its threads gone."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(xk.XferError, match="dead_after_s"):
        Session.from_config(ref.srcs[0].manifest, {"dead_after_s": 0.5}, env={})
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before


def test_the_config_names_every_keyword_of_the_session_with_its_default() -> None:
    """A new Session keyword without a config field (or a default stated twice, drifting)
    fails here."""
    import inspect

    params = {
        p.name: p.default
        for p in inspect.signature(Session.__init__).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in ("keys", "on_finished", "on_pair")
    }
    c = SessionConfig()
    assert set(c.session_kwargs()) == set(params)
    assert c.session_kwargs() == params


def test_from_config_refuses_what_it_cannot_use_leaving_nothing_open() -> None:
    """Before: an unknown option was a raw TypeError."""
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(xk.ArgumentError, match="bogus"):
        Session.from_config(ref.srcs[0].manifest, {}, env={}, bogus=1)
    with pytest.raises(xk.ArgumentError, match="needs a Manifest"):
        Session.from_config(3, {}, env={})  # type: ignore[arg-type]
    with pytest.raises(xk.XferError, match="pp_rank"):
        Session.from_config(ref.srcs[0].manifest, {"pp_rank": 10**30}, env={})
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
