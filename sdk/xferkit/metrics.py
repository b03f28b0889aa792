"""Prometheus metrics of a Session's requests (the optional extra ``xferkit[metrics]``).

``Metrics`` holds the Session's two hooks: ``on_finished`` counts each request
that ends and observes its timeline, labelled by role (prefill or decode),
driver and outcome, with the buckets vLLM's NIXL connector and NIXL's own
telemetry use for transfer times, so dashboards built for those carry over;
``on_pair`` counts handshakes and peers lost::

    metrics = xferkit.metrics.Metrics(driver="mooncake")
    session = xferkit.Session(
        backend, manifest, on_finished=metrics.on_finished, on_pair=metrics.on_pair
    )
    prometheus_client.start_http_server(9400)  # or the engine's own registry

An engine that keeps its own metrics passes its own ``on_finished`` instead and
reads the same ``handle.times``, ``handle.routes`` and ``handle.timeline``. The core imports this
module (and ``prometheus_client``) only when asked.
"""

from __future__ import annotations

import weakref
from typing import Any

from .errors import XferError
from .session import PairEvent, Receive, Send, Session, State

try:
    import prometheus_client as prom
except ImportError as exc:  # the extra is not installed
    raise XferError(
        "xferkit.metrics needs prometheus_client: pip install 'xferkit[metrics]'"
    ) from exc

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Request and transfer time buckets (seconds), as vLLM's NIXL connector's."""
BYTES = tuple(float(1 << k) for k in range(12, 37, 2))  # 4 KiB .. 64 GiB
COUNTS = tuple(float(4**k) for k in range(10))  # 1 .. 262,144 descriptors
LABELS = ("role", "driver")


class Metrics:
    """Counters and histograms of finished requests, in ``registry`` (the default one if
    None); ``on_finished`` is the Session hook."""

    def __init__(self, driver: str, registry: Any = None) -> None:
        if not isinstance(driver, str):
            raise XferError(f"driver is the backend's name, not {driver!r}")
        self.driver = driver
        reg = prom.REGISTRY if registry is None else registry
        made = self._make()
        done: list[Any] = []
        try:
            for collector in made:
                reg.register(collector)
                done.append(collector)
        except ValueError as exc:  # prometheus_client: a family of that name is there already
            for collector in done:  # refused: nothing of it stays registered
                reg.unregister(collector)
            raise XferError(
                f"xferkit metrics are registered in {reg!r} already ({exc}): share one Metrics "
                "between the Sessions of a process (its labels say the role), or pass registry="
            ) from None

    def _make(self) -> list[Any]:
        """The collectors, not registered yet."""
        reg = None
        self.requests = prom.Counter(
            "xferkit_requests", "Requests that ended, by outcome",
            [*LABELS, "outcome", "stage"], registry=reg,
        )  # fmt: skip
        self.request_seconds = prom.Histogram(
            "xferkit_request_seconds", "expect/offer to DONE", LABELS,
            buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.handshake_seconds = prom.Histogram(
            "xferkit_handshake_seconds", "expect to its Requests sent (decode side)", LABELS,
            buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.transfer_seconds = prom.Histogram(
            "xferkit_transfer_seconds", "first write (prefill) or completion (decode) to DONE",
            LABELS, buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.chunks = prom.Counter(
            "xferkit_chunks", "Chunks written per decode rank, by route", [*LABELS, "route"],
            registry=reg,
        )  # fmt: skip
        self.bytes = prom.Counter(
            "xferkit_bytes", "Bytes written, by route", [*LABELS, "route"], registry=reg
        )
        self.descriptors = prom.Counter(
            "xferkit_descriptors", "Wire descriptors posted, by route", [*LABELS, "route"],
            registry=reg,
        )  # fmt: skip
        self.stage_seconds = prom.Histogram(
            "xferkit_stage_seconds",
            "A request's work per stage on this rank (handle.timeline's busy: plan, pack, post, "
            "wire, unpack)", [*LABELS, "stage"], buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.request_bytes = prom.Histogram(
            "xferkit_request_bytes", "Bytes a request wrote (prefill side)", LABELS,
            buckets=BYTES, registry=reg,
        )  # fmt: skip
        self.request_descriptors = prom.Histogram(
            "xferkit_request_descriptors", "Wire descriptors a request posted (prefill side)",
            LABELS, buckets=COUNTS, registry=reg,
        )  # fmt: skip
        self.handshakes = prom.Counter(
            "xferkit_handshakes", "Pair handshakes that ended, by peer and outcome (ok, failed)",
            [*LABELS, "peer", "outcome"], registry=reg,
        )  # fmt: skip
        self.peers_lost = prom.Counter(
            "xferkit_peers_lost", "Working pairs that ended (the peer silent, restarted, closed)",
            [*LABELS, "peer"], registry=reg,
        )  # fmt: skip
        self.staging_in_use = prom.Gauge(
            "xferkit_staging_in_use_bytes", "Staging its requests hold now, per Session",
            ["driver", "session"], registry=reg,
        )  # fmt: skip
        self.staging_size = prom.Gauge(
            "xferkit_staging_bytes", "Staging a Session registered", ["driver", "session"],
            registry=reg,
        )  # fmt: skip
        self.staging_wait_seconds = prom.Histogram(
            "xferkit_staging_wait_seconds", "How long a request's chunks waited for staging",
            LABELS, buckets=(0.0, *SECONDS), registry=reg,
        )  # fmt: skip
        return [
            self.requests, self.request_seconds, self.handshake_seconds, self.transfer_seconds,
            self.chunks, self.bytes, self.descriptors, self.stage_seconds, self.request_bytes,
            self.request_descriptors, self.handshakes, self.peers_lost, self.staging_in_use,
            self.staging_size, self.staging_wait_seconds,
        ]  # fmt: skip

    def watch(self, session: Session) -> None:
        """Export ``session``'s staging in use (``xferkit_staging_in_use_bytes{session}``) and
        its size, read at each scrape; the Session is held weakly (a dropped one reads 0)."""
        if not isinstance(session, Session):
            raise XferError(f"watch() takes a Session, not {session!r}")
        ref, labels = weakref.ref(session), {"driver": self.driver, "session": session.address}

        def in_use() -> float:
            s = ref()
            return 0.0 if s is None else float(s.staging_in_use)

        self.staging_in_use.labels(**labels).set_function(in_use)
        self.staging_size.labels(**labels).set(session.staging_size)

    def on_pair(self, event: PairEvent) -> None:
        """Count a pair's handshake or its loss (the Session's ``on_pair`` hook)."""
        labels = {"role": event.role, "driver": self.driver, "peer": event.peer}
        if event.event == "lost":
            self.peers_lost.labels(**labels).inc()
        else:
            self.handshakes.labels(
                **labels, outcome="ok" if event.event == "up" else "failed"
            ).inc()

    def on_finished(self, handle: Receive | Send) -> None:
        """Count ``handle``'s request and observe its timeline (called once per request)."""
        role = "decode" if isinstance(handle, Receive) else "prefill"
        labels = {"role": role, "driver": self.driver}
        t = handle.times
        error = handle.error
        outcome = "failed" if error is not None else "done"
        self.requests.labels(**labels, outcome=outcome, stage=error.stage if error else "").inc()
        routes = handle.routes
        self.staging_wait_seconds.labels(**labels).observe(routes.staging_wait_s)
        for route, n, nbytes, descriptors in (
            ("staged", routes.staged, routes.staged_bytes, routes.staged_descriptors),
            ("direct", routes.direct, routes.direct_bytes, routes.direct_descriptors),
        ):
            if n:
                self.chunks.labels(**labels, route=route).inc(n)
                self.bytes.labels(**labels, route=route).inc(nbytes)
                self.descriptors.labels(**labels, route=route).inc(descriptors)
        for stage, span in handle.timeline.items():
            if stage != "landed":  # a span of arrivals, no work
                self.stage_seconds.labels(**labels, stage=stage).observe(span.busy)
        if role == "prefill":
            self.request_bytes.labels(**labels).observe(routes.staged_bytes + routes.direct_bytes)
            posted = routes.staged_descriptors + routes.direct_descriptors
            self.request_descriptors.labels(**labels).observe(posted)
        if error is not None or State.DONE not in t:
            return
        start = min(t.values())
        self.request_seconds.labels(**labels).observe(t[State.DONE] - start)
        if State.HANDSHAKING in t and State.WAITING in t:
            self.handshake_seconds.labels(**labels).observe(t[State.WAITING] - start)
        if State.TRANSFERRING in t:
            self.transfer_seconds.labels(**labels).observe(t[State.DONE] - t[State.TRANSFERRING])
