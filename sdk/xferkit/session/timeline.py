"""Where a request's time went on one rank: a span per stage, read from ``handle.timeline``.

The stages, each timed where its work runs (``time.monotonic``, so the spans of
ranks on one host share a clock):

- prefill: ``plan`` (cutting each chunk into descriptors and staged rounds, on
  the control thread), ``pack`` (gathering pieces into staging, on the pack
  worker), ``post`` (inside the driver's post call, on the data-plane thread),
  ``wire`` (each write, from its post to its completion);
- decode: ``landed`` (the first to the last notification of the request's data),
  ``unpack`` (scattering staged rounds out of staging, on the control thread).

The handshake and the waits are ``handle.times`` (the states and when they
were reached). A stage's ``busy`` is its work summed: less than ``end -
start`` where the work came in pieces with gaps (chunks, rounds), more where
pieces ran at once (writes in flight together); the stages' spans overlap as
chunks pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

STAGES: Final = ("plan", "pack", "post", "wire", "landed", "unpack")


class Span(msgspec.Struct, frozen=True):
    """One stage of a request on this rank: when its first piece of work began and its last
    ended (monotonic seconds), and how long the work itself took, summed."""

    start: float
    end: float
    busy: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    """The spans of one request, as the core accumulates them (a few floats per stage)."""

    __slots__ = ("_spans",)

    def __init__(self) -> None:
        self._spans: dict[str, list[float]] = {}

    def add(self, stage: str, start: float, end: float) -> None:
        span = self._spans.get(stage)
        if span is None:
            self._spans[stage] = [start, end, end - start]
        else:
            span[0], span[1] = min(span[0], start), max(span[1], end)
            span[2] += end - start

    def spans(self) -> Mapping[str, Span]:
        return {stage: Span(*s) for stage, s in self._spans.items()}
