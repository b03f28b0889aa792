"""How often the control thread polls a driver that offers no notification descriptor.

NIXL and Mooncake have none: a decode rank waiting for writes polls its notifications.
Every millisecond, while a request waited, was almost half the decode ranks' passes in the
engine-shaped load on NIXL (a request queued behind a busy prefill waits seconds). The
polls now back off while a pass finds nothing to do, and any message (a source's ``Poke``
as its write ends), command or notification brings them back to every ``POLL_S``.
"""

from __future__ import annotations

POLL_S = 0.001
"""The poll interval while something happens."""
POLL_MAX_S = 0.004
"""The most it backs off to, doubling after each pass that found nothing."""


class Cadence:
    """The wait before the next poll, from whether the last pass found anything."""

    def __init__(self) -> None:
        self.wait_s = POLL_S

    def passed(self, active: bool) -> None:
        self.wait_s = POLL_S if active else min(2 * self.wait_s, POLL_MAX_S)
