"""xferkit.metrics scraped from a live Session pair: what an engine's dashboard reads."""

from __future__ import annotations

import time

import prometheus_client as prom
import pytest

from xferkit import Backend, XferError
from xferkit.metrics import Metrics
from xferkit.session import Session, State
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver

SLOTS = {"kv": 8, "state": 4}


def _sample(registry: prom.CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_live_sessions_requests_are_counted_and_timed() -> None:
    registry = prom.CollectorRegistry()
    metrics = Metrics("mock", registry)
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest, on_finished=metrics.on_finished)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, on_finished=metrics.on_finished)
    try:
        for i in range(3):
            recv = dec.expect(f"r{i}", [pre.address], {"kv": [2 + i]})
            pre.offer(f"r{i}").write({"kv": [1]}, last=True)
            assert recv.wait(10) is State.DONE
        dec.expect("gone", [pre.address], {"kv": [7]}).abort(10)
        prefill, decode = (
            {"role": "prefill", "driver": "mock"},
            {"role": "decode", "driver": "mock"},
        )
        limit = time.monotonic() + 10  # the prefill's DONE may come a moment after the decode's
        while time.monotonic() < limit:
            if (
                _sample(registry, "xferkit_requests_total", **prefill, outcome="done", stage="")
                == 3
            ):
                break
            time.sleep(0.05)
        assert _sample(registry, "xferkit_requests_total", **decode, outcome="done", stage="") == 3
        assert _sample(registry, "xferkit_requests_total", **prefill, outcome="done", stage="") == 3
        failed = _sample(
            registry, "xferkit_requests_total", **decode, outcome="failed", stage="abort"
        )
        assert failed == 1
        assert _sample(registry, "xferkit_request_seconds_count", **decode) == 3
        assert 0 < _sample(registry, "xferkit_request_seconds_sum", **decode) < 30
        assert _sample(registry, "xferkit_transfer_seconds_count", **decode) == 3
        assert _sample(registry, "xferkit_handshake_seconds_count", **decode) == 3
        # the text an exporter serves names every family
        text = prom.generate_latest(registry).decode()
        moved = [
            _sample(registry, "xferkit_bytes_total", **prefill, route=r)
            for r in ("staged", "direct")
        ]
        assert sum(moved) > 0
        for family in ("xferkit_requests_total", "xferkit_staging_wait_seconds_bucket"):
            assert family in text
        # the timeline's stages, per role: the prefill's work, the decode's arrivals
        for stage in ("plan", "post", "wire"):
            assert _sample(registry, "xferkit_stage_seconds_count", **prefill, stage=stage) == 3
        assert _sample(registry, "xferkit_stage_seconds_count", **decode, stage="landed") == 0
        assert _sample(registry, "xferkit_request_bytes_count", **prefill) == 3
        assert _sample(registry, "xferkit_request_bytes_sum", **prefill) == sum(moved)
        assert _sample(registry, "xferkit_request_descriptors_sum", **prefill) >= 3
    finally:
        pre.close()
        dec.close()


def test_handshakes_and_peers_lost_are_counted_per_role() -> None:
    registry = prom.CollectorRegistry()
    metrics = Metrics("mock", registry)
    hooks = {"on_finished": metrics.on_finished, "on_pair": metrics.on_pair}
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest, **hooks)  # type: ignore[arg-type]
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, **hooks)  # type: ignore[arg-type]
    decode = {"role": "decode", "driver": "mock"}
    try:
        recv = dec.expect("r", [pre.address], {"kv": [2]})
        pre.offer("r").write({"kv": [1]}, last=True)
        assert recv.wait(10) is State.DONE
        for role, peer in (("decode", pre.address), ("prefill", dec.address)):
            ok = {"role": role, "driver": "mock", "peer": peer, "outcome": "ok"}
            assert _sample(registry, "xferkit_handshakes_total", **ok) == 1
        lost = {**decode, "peer": pre.address}
        assert _sample(registry, "xferkit_peers_lost_total", **lost) == 0
        pre.close()  # its Bye: the decode rank's pair is lost
        limit = time.monotonic() + 10
        while not _sample(registry, "xferkit_peers_lost_total", **lost):
            assert time.monotonic() < limit, "the lost pair was not counted"
            time.sleep(0.02)
        assert _sample(registry, "xferkit_peers_lost_total", **lost) == 1
    finally:
        pre.close()
        dec.close()


def test_a_hook_that_raises_is_logged_and_the_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(handle: object) -> None:
        raise RuntimeError("dashboard down")

    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest, on_finished=broken)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest, on_finished=broken)
    try:
        for i in range(2):
            recv = dec.expect(f"r{i}", [pre.address], {"kv": [2 + i]})
            pre.offer(f"r{i}").write({"kv": [1]}, last=True)
            assert recv.wait(10) is State.DONE
        assert "dashboard down" in caplog.text
    finally:
        pre.close()
        dec.close()


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(XferError, match="on_finished must be callable"):
        ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
        with Backend(MockDriver()) as backend:
            Session(backend, ref.srcs[0].manifest, on_finished=3)  # type: ignore[arg-type]
    with pytest.raises(XferError, match="driver is the backend's name"):
        Metrics(3)  # type: ignore[arg-type]


def test_a_second_metrics_in_one_registry_is_refused_and_leaves_the_first_intact() -> None:
    """prometheus_client raises ValueError on a duplicate family: an engine that made one
    Metrics per Session got a raw ValueError."""
    registry = prom.CollectorRegistry()
    first = Metrics("mock", registry)
    before = set(registry._names_to_collectors)
    with pytest.raises(XferError, match=r"registered in .* already"):
        Metrics("other", registry)
    first.requests.labels(role="decode", driver="mock", outcome="done", stage="").inc()
    assert _sample(registry, "xferkit_requests_total", role="decode", driver="mock",
                   outcome="done", stage="") == 1  # fmt: skip
    assert set(registry._names_to_collectors) == before


def test_staging_in_use_is_exported_while_a_request_holds_it() -> None:
    """``Metrics.watch``: a gauge read at each scrape, non-zero while a staged write is stuck
    in the driver, zero once the request ended and gave its staging back."""
    import xferkit as xk
    from xferkit.testing import RegionSpec
    from xferkit_loopback import Faults

    specs = [  # NHD pages, heads split 1 -> 2: every chunk packs on the prefill rank
        RegionSpec(pool="kv", name=n, layer=0, shape=(16, 8, 32), tp_axis=1) for n in "kv"
    ]
    slots = {"kv": 16}
    ref = Reference(specs, src_tp=1, dst_tp=2, src_slots=slots, dst_slots=slots)
    registry = prom.CollectorRegistry()
    metrics = Metrics("loopback", registry)
    stuck = xk.open_backend("loopback", faults=Faults(stall_post_at=1))
    pre = Session(stuck, ref.srcs[0].manifest, staging="auto")
    decs = [Session(xk.open_backend("loopback"), d.manifest) for d in ref.dsts]
    labels = {"driver": "loopback", "session": pre.address}
    try:
        metrics.watch(pre)
        assert _sample(registry, "xferkit_staging_bytes", **labels) == pre.staging_size > 0
        assert _sample(registry, "xferkit_staging_in_use_bytes", **labels) == 0
        recvs = [d.expect("r", [pre.address], {"kv": [3, 4]}) for d in decs]
        send = pre.offer("r")
        send.write({"kv": [1, 2]}, last=True)
        limit = time.monotonic() + 10
        while not _sample(registry, "xferkit_staging_in_use_bytes", **labels):
            assert time.monotonic() < limit, "no staging was ever in use"
            time.sleep(0.01)
        send.abort(10)
        for r in recvs:
            r.abort(10)
        assert _sample(registry, "xferkit_staging_in_use_bytes", **labels) == 0
    finally:
        for s in (pre, *decs):
            s.close()
    with pytest.raises(XferError, match="watch\\(\\) takes a Session"):
        metrics.watch("tcp://x")  # type: ignore[arg-type]
