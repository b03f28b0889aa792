"""What a request's handle reports: its ``State``, and the ``RequestError`` that says why it
failed. Plain values, shared by the protocol core and the engine-facing handles."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from ..errors import XferError


class State(enum.IntEnum):
    """Ordered so a TP group can all-reduce the minimum (sglang's KVPoll order)."""

    FAILED = 0
    HANDSHAKING = 1
    WAITING = 2
    TRANSFERRING = 3
    DONE = 4


STAGES = ("handshake", "plan", "transfer", "timeout", "abort", "peer lost", "closed", "request")
"""Where a request can fail; ``RequestError.stage`` is one of these."""


class Routes(msgspec.Struct, frozen=True):
    """How a request went, known once it ended: ``staged`` and ``direct`` count its chunks
    (one per decode rank written) by route, ``staging_wait_s`` is how long they waited for
    staging memory (summed; a busy Session queues a chunk rather than send it the slower
    way), ``staged_bytes`` and ``direct_bytes`` what went each way (a staged chunk's
    descriptors that need no gathering go direct), ``staged_descriptors`` and
    ``direct_descriptors`` the wire descriptors its writes posted each way (a staged
    round's copies after joining), ``peers`` the session addresses of the ranks it moved
    data with, ``writes`` the writes it posted (direct ones, and a staged chunk's rounds;
    chunks that queued together are joined and share them). On the decode side
    the counts, bytes and descriptors are 0: the routes are the prefill rank's choice.
    Nothing is retried: a write that fails fails its request."""

    staged: int = 0
    direct: int = 0
    staging_wait_s: float = 0.0
    staged_bytes: int = 0
    direct_bytes: int = 0
    staged_descriptors: int = 0
    direct_descriptors: int = 0
    peers: tuple[str, ...] = ()
    writes: int = 0


@dataclass(frozen=True, slots=True)
class PairEvent:
    """A pair with a peer changed, as ``Session(on_pair=...)`` is told: ``event`` is ``"up"``
    (its handshake succeeded), ``"failed"`` (it did not: refused, unreachable, timed out) or
    ``"lost"`` (a working pair ended: the peer went silent, restarted or closed); ``role`` is
    this rank's side ("prefill" or "decode"), ``peer`` the peer's session address, ``why``
    the reason (empty for "up")."""

    role: str
    peer: str
    event: str
    why: str = ""


class RequestError(XferError):
    """Why a request failed: the root cause, the same text on both sides of the request.

    ``stage`` is one of ``STAGES``; ``peer`` is the session address of the peer
    concerned (when there is one).
    """

    def __init__(self, text: str, *, stage: str, request_id: str, peer: str | None = None) -> None:
        super().__init__(text, subject=request_id)
        self.stage = stage
        self.request_id = request_id
        self.peer = peer
