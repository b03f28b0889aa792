"""When a peer that failed may be tried again: a bounded, jittered exponential backoff, so a
failed peer is never blacklisted for good nor retried in a tight loop."""

from __future__ import annotations

import random

_RNG = random.Random()


class Backoff:
    """When a peer that failed may be tried again: exponential, bounded, reset by a Welcome."""

    __slots__ = ("failures", "retry_at")

    def __init__(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def failed(self, now: float, low: float, high: float, rng: random.Random = _RNG) -> float:
        """Record one more failure; the delay before the next try (jittered, at most ``high``)."""
        delay = min(high, low * 2.0**self.failures) * rng.uniform(0.5, 1.0)
        self.failures += 1
        self.retry_at = now + delay
        return delay
