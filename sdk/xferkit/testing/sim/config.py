"""What one simulated schedule may contain: its ranks, its engine's requests, its faults."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...session.core import MAX_UNOFFERED

FAULTS = frozenset(
    {
        "delay",  # messages take from microseconds to seconds
        "partition",  # a pair of hosts cannot talk for a while, then heals (TCP holds the bytes)
        "stall",  # a driver write stalls until its timeout
        "fail",  # a driver write fails after landing part of its bytes
        "pause",  # a rank is stopped (SIGSTOP) for up to ``max_pause_s``, then resumes
        "crash",  # a rank is killed (SIGKILL) and restarts as a new incarnation
        "clock",  # a rank's monotonic clock jumps forward
        "hostile",  # a third peer with a trusted key replays, forges and floods messages
        "abort",  # the engine aborts requests at any point
        "close",  # the engine closes a rank's Session at any time (and starts a new one)
        "reuse",  # request ids are reused once every rank of the last use is terminal
    }
)
"""Faults a schedule draws from by default: what ZMQ over TCP and a correct driver can do."""

HARSH = frozenset(
    {
        "reorder",  # messages on one connection overtake each other (ZMQ never does this)
        "duplicate",  # a message is delivered twice (ZMQ never does this)
        "loss",  # a message is lost without a reconnect (ZMQ never does this)
        "late",  # a driver lands bytes after it reported the write ended (UCX over TCP did)
        "frozen",  # a stopped rank's writes land only once it resumes (a TCP transport's)
        "impersonate",  # the hostile peer presents the endpoint of a decode rank not paired now
    }
)
"""Faults beyond the contracts: the protocol is not expected to survive all of them."""


INSTANCES = "PQR"
"""The prefill instances' rank names: ``P0, P1, ...``, ``Q0, ...``, ``R0, ...``."""
DECODE_INSTANCES = "DEF"
"""The decode instances' rank names: ``D0, ...``, ``E0, ...``, ``F0, ...``."""


@dataclass(frozen=True)
class Config:
    """One simulation's shape; ``faults`` may name any of ``FAULTS | HARSH``."""

    prefill_tp: int = 2
    prefill_pp: int = 1  # pipeline stages of the prefill instance (each holds its layers)
    instances: int = 1  # prefill instances of that shape (P0.., Q0.., R0..); each request one
    decode_instances: int = 1  # decode instances (D0.., E0.., F0..); each request one
    decode_tp: int = 2
    decode_pp: int = 1  # pipeline stages of each decode instance (each holds its layers)
    requests: int = 6
    arrivals_s: float = 20.0  # requests arrive within this many simulated seconds
    hostile_acts: int = 12  # the most bursts the hostile peer sends ("hostile")
    abort_p: float = 0.15  # the chance a request is aborted by one of its ranks ("abort")
    close_p: float = 0.03  # the chance a request's start sees a rank's Session closed ("close")
    max_pause_s: float = 25.0  # past the drain bound (drain_s + dead_after_s) on purpose
    faults: frozenset[str] = field(default=FAULTS)
    staging: str = "auto"  # the Session's default: the cost model picks each chunk's route
    staging_bytes: int = 1 << 14  # per rank: two requests' slices, so requests queue for it
    slice_bytes: int = 1 << 13
    groups: float = 0.5  # the share of requests naming the prefill instance by its group
    skip: float = 0.0  # the share whose decode holds a prefix of the KV pages (expect(skip=))
    layered: float = 0.0  # the share whose prefill writes each chunk layer by layer
    notifying: bool = True  # the driver carries completions; False: ``Written`` on the socket
    fencing: bool = False  # decode drivers fence a lost source (``Capabilities.fencing``)
    fence_cuts_all: bool = False  # ... and every other source with it (Mooncake's way)
    ends_final: bool = True  # False: a cancelled write's bytes still land (NIXL over UCX TCP)
    packer: bool = False  # staged rounds pack on a worker (the Session's), not in the call
    max_unoffered: int = MAX_UNOFFERED  # the prefill's bound; small, a flood reaches it
    kv_slots: int = 16
    state_slots: int = 8
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0
    handshake_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    lease_s: float = 20.0
    drain_s: float = 10.0
    max_steps: int = 200_000

    def __post_init__(self) -> None:
        for name, share in (("skip", self.skip), ("layered", self.layered)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} {share}: a share, 0 to 1")
        if self.staging not in ("never", "auto", "always"):
            raise ValueError(f"staging {self.staging!r}: never, auto or always")
        for name, n in (("instances", self.instances), ("decode_instances", self.decode_instances)):
            if not 1 <= n <= len(INSTANCES):
                raise ValueError(f"{name} {n}: 1 to {len(INSTANCES)}")
        if not self.ends_final and not self.notifying:
            raise ValueError("ends_final=False needs notifying (Capabilities.ends_are_final)")
        unknown = set(self.faults) - FAULTS - HARSH
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS | HARSH)}")

    @property
    def bound_s(self) -> float:
        """How long any request may stay open after it began, whatever the faults: its deadlines
        (handshake, request, drain after the abort it may need) and one pause of each side."""
        return (
            self.handshake_timeout_s
            + max(self.request_timeout_s, self.lease_s)
            + self.drain_s
            + 2 * self.dead_after_s
            + 2 * self.max_pause_s
            + 5.0
        )
