"""What the bench records per request and per case (the JSON of ``xferkit bench --json``).

A request's record holds each rank's own ``expect``/``offer`` -> DONE interval
(monotonic seconds, one clock per host), the plan's bytes and descriptors, how
its chunks went (``handle.routes`` of every rank: chunks staged and direct,
seconds waited for staging), its ``states`` (``{state: [start, end]}`` from the
last decode rank's ``handle.times``), its ``timeline`` (every rank's
``handle.timeline`` merged: ``{stage: [first start, last end, the most busy
rank's work]}``), both in seconds from the request's start, and its ``split``:
where the decode side's wait went, stage by stage (``STAGES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATES = ("handshake", "waiting", "transfer")
"""The states a decode handle goes through: ``expect`` to its Requests sent (HANDSHAKING:
pairs, plans, staging offered), to the first byte's completion (WAITING: the prefill's
chunks and packs), to DONE (TRANSFERRING)."""
_STATES = ("HANDSHAKING", "WAITING", "TRANSFERRING", "DONE")

STAGES = ("handshake", "plan", "pack", "post", "wire", "notify", "unpack", "control")
"""The split of a request's latency (seconds): ``handshake`` (the decode side's, to its
Requests sent), ``plan``, ``pack`` and ``post`` (the work of the busiest prefill rank:
cutting descriptors and rounds, gathering into staging, inside the driver's post), ``wire``
(first post to last write completion, any prefill rank), ``notify`` (the last write's
completion to the last notification's arrival on a decode rank), ``unpack`` (the busiest
decode rank's scattering), and ``control``: the part of the latency no stage covers
(messages, queues, the control loops). Stages overlap as chunks pipeline, so they add up
to more than the latency where the pipeline works."""


@dataclass
class Record:
    id: str
    bytes: int
    descriptors: int
    decode: list[tuple[float, float]] = field(default_factory=list)  # per decode rank
    prefill: list[tuple[float, float]] = field(default_factory=list)  # per prefill rank
    verified: bool | None = None
    warmup: bool = False
    states: dict[str, tuple[float, float]] = field(default_factory=dict)
    spans: dict[str, list[float]] = field(default_factory=dict)  # stage -> [start, end, busy]
    staged: int = 0  # chunks (per decode rank written) by route, over every prefill rank
    direct: int = 0
    staging_wait_s: float = 0.0  # the longest any rank's chunks waited for staging
    staged_bytes: int = 0
    direct_bytes: int = 0
    writes: int = 0  # posted (chunks joined to the one before share its writes)
    _last_done: float = field(default=-1.0, repr=False)

    def times(self, times: dict[str, float]) -> None:
        """The timeline from a decode rank's ``handle.times`` (the last to finish wins)."""
        done = times.get("DONE")
        if done is None or done < self._last_done:
            return
        self._last_done = done
        marks = [times.get(s) for s in _STATES]
        self.states = {
            stage: (a, b)
            for stage, a, b in zip(STATES, marks, marks[1:], strict=False)
            if a is not None and b is not None
        }

    def timeline(self, spans: dict[str, tuple[float, float, float]]) -> None:
        """Merge one rank's ``handle.timeline``."""
        for stage, (start, end, busy) in spans.items():
            have = self.spans.get(stage)
            if have is None:
                self.spans[stage] = [start, end, busy]
            else:
                have[:] = [min(have[0], start), max(have[1], end), max(have[2], busy)]

    def split(self) -> dict[str, float]:
        """The latency's split by ``STAGES`` (seconds)."""
        s, hs = self.spans, self.states.get("handshake")
        out = {"handshake": hs[1] - hs[0] if hs else 0.0}
        out.update({k: s[k][2] if k in s else 0.0 for k in ("plan", "pack", "post")})
        wire, landed = s.get("wire"), s.get("landed")
        out["wire"] = wire[1] - wire[0] if wire else 0.0
        out["notify"] = max(landed[1] - wire[1], 0.0) if wire and landed else 0.0
        out["unpack"] = s["unpack"][2] if "unpack" in s else 0.0
        lo, hi = min(a for a, _ in self.decode), max(b for _, b in self.decode)
        covered = [(a, b) for a, b, *_ in [*s.values(), *([hs] if hs else [])]]
        out["control"] = max(hi - lo - _union(covered, lo, hi), 0.0)
        return out

    def route(
        self,
        staged: int,
        direct: int,
        waited: float,
        staged_bytes: int,
        direct_bytes: int,
        writes: int = 0,
    ) -> None:
        """Add one rank's ``handle.routes``."""
        self.writes += writes
        self.staged += staged
        self.direct += direct
        self.staged_bytes += staged_bytes
        self.direct_bytes += direct_bytes
        self.staging_wait_s = max(self.staging_wait_s, waited)

    @property
    def start(self) -> float:
        return min(s for s, _ in self.decode + self.prefill)

    @property
    def end(self) -> float:
        return max(e for _, e in self.decode)

    @property
    def latency_s(self) -> float:
        """The handoff as the decode side sees it: first ``expect`` to the last rank's DONE."""
        return max(e for _, e in self.decode) - min(s for s, _ in self.decode)

    def to_json(self) -> dict[str, Any]:
        t0 = self.start
        return {
            "id": self.id,
            "bytes": self.bytes,
            "descriptors": self.descriptors,
            "routes": {
                "plan": {"bytes": self.bytes, "descriptors": self.descriptors},
                "staged_chunks": self.staged,
                "direct_chunks": self.direct,
                "writes": self.writes,
                "staged_bytes": self.staged_bytes,
                "direct_bytes": self.direct_bytes,
                "staging_wait_s": self.staging_wait_s,
            },
            "start": self.start,
            "end": self.end,
            "latency_s": self.latency_s,
            "decode": [list(x) for x in self.decode],
            "prefill": [list(x) for x in self.prefill],
            "verified": self.verified,
            "warmup": self.warmup,
            "states": {k: [a - t0, b - t0] for k, (a, b) in self.states.items()},
            "timeline": {k: [a - t0, b - t0, busy] for k, (a, b, busy) in self.spans.items()},
            "split": self.split(),
        }


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of [lo, hi] the spans cover together."""
    total, reach = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def summary(records: list[Record]) -> dict[str, Any]:
    """Throughput over the span of the measured requests, latency percentiles."""
    span = max(r.end for r in records) - min(r.start for r in records)
    total = sum(r.bytes for r in records)
    lat = np.array([r.latency_s for r in records])
    checked = [r.verified for r in records]
    waits = np.array([r.staging_wait_s for r in records])
    splits = [r.split() for r in records]
    return {
        "requests": len(records),
        "bytes_per_request": int(np.median([r.bytes for r in records])),
        "descriptors_per_request": int(np.median([r.descriptors for r in records])),
        "span_s": span,
        "gbps": total / span / 1e9,
        "requests_per_s": len(records) / span,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "verified": None if any(c is None for c in checked) else all(checked),
        "staged_chunks": sum(r.staged for r in records),
        "direct_chunks": sum(r.direct for r in records),
        "writes": sum(r.writes for r in records),
        "staging_wait_p99_ms": float(np.percentile(waits, 99) * 1e3),
        "split_p50_ms": {
            stage: float(np.median([split[stage] for split in splits]) * 1e3) for stage in STAGES
        },
    }
