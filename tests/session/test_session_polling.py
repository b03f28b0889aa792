"""A decode rank whose driver offers no notification descriptor (NIXL) polls for its
notifications while it waits for writes. It used to poll every millisecond for as long as
a request waited, whatever happened; polls now back off to ``polling.POLL_MAX_S`` while the
passes find nothing, and come back to every ``POLL_S`` on any message or command."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import xferkit as xk
from xferkit.backend import Backend
from xferkit.session import Session, State, polling
from xferkit.testing.conformance import require_backend

require_backend("nixl")


def _session(buf: np.ndarray) -> Session:
    region = xk.Region.from_array(buf.reshape(8, -1), pool="kv", name="k", layer=0)
    # Heartbeats far apart: their messages would bring the polls back to POLL_S.
    manifest = xk.Manifest.build([region])
    return Session(xk.open_backend("nixl"), manifest, heartbeat_s=5.0, dead_after_s=20.0)


def test_a_decode_rank_waiting_on_a_quiet_prefill_polls_its_notifications_less_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    polls = [0]
    drain = Backend.notifications

    def counted(self: Backend) -> list[xk.Notification]:
        polls[0] += 1
        return drain(self)

    monkeypatch.setattr(Backend, "notifications", counted)
    src = np.arange(8 * 4096, dtype=np.uint32).view(np.uint8)[: 8 * 4096].copy()
    dst = np.zeros(8 * 4096, dtype=np.uint8)
    pre, dec = _session(src), _session(dst)
    try:
        recv = dec.expect("r", [pre.address], {"kv": [1]})  # no source has offered it yet
        limit = time.monotonic() + 10
        while recv.poll() is State.HANDSHAKING:
            assert time.monotonic() < limit, recv.poll()
            time.sleep(0.01)
        time.sleep(0.2)
        before = polls[0]
        time.sleep(1.0)
        idle = polls[0] - before
        pre.offer("r").write({"kv": [2]}, last=True)
        assert recv.wait(10) is State.DONE
        assert (dst.reshape(8, -1)[1] == src.reshape(8, -1)[2]).all()
    finally:
        pre.close()
        dec.close()
    # About 1 / POLL_MAX_S a second; every millisecond before (about a thousand).
    assert idle < 0.6 / polling.POLL_S, f"{idle} polls in 1 s of a request waiting"
    # It still polls (a notification that came after its poke is found): a floor well below
    # the 250 a second of an idle pass every POLL_MAX_S, so a loaded CI machine passes too.
    assert idle > 0.1 / polling.POLL_MAX_S, f"{idle} polls in 1 s: does it poll at all?"


@given(st.lists(st.booleans(), max_size=30))
def test_the_cadence_backs_off_to_its_bound_and_comes_back_on_activity(passes: list[bool]) -> None:
    c = polling.Cadence()
    idle = 0  # passes in a row that found nothing
    for active in passes:
        c.passed(active)
        idle = 0 if active else idle + 1
        assert c.wait_s == min(polling.POLL_S * 2**idle, polling.POLL_MAX_S)
