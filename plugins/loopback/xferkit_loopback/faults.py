"""Fault injection: make the loopback fail the way real RDMA engines do, on cue."""

from __future__ import annotations

import msgspec


class Faults(msgspec.Struct, kw_only=True):
    """Counters are 1-based over the backend's life; change them at any time."""

    fail_register_at: int | None = None  # the Nth region registration is refused
    fail_post_at: int | None = None  # the Nth posted batch fails
    stall_post_at: int | None = None  # the Nth posted batch never completes (until aborted)
    lose_notification_at: int | None = None  # the Nth notification sent is never delivered
    dropped_peers: set[str] = msgspec.field(default_factory=set)  # peer names now unreachable
