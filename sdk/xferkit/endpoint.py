"""The core's envelope around a driver's endpoint blob: which driver, which process, who.

A control plane reads the driver address out of an endpoint before it lets the
backend connect to it (``endpoint_address``), so that a peer cannot present
another peer's, or this rank's own, memory as its own.
"""

from __future__ import annotations

import msgspec

from .errors import ProtocolError


class Envelope(msgspec.Struct, frozen=True):
    """What ``Backend.endpoint`` wraps around the driver's blob."""

    backend: str
    contract: int
    host: str
    pid: int
    address: str
    generation: int  # the sender's registration generation when it made the endpoint
    blob: msgspec.Raw


def open_envelope(endpoint: object, who: str) -> Envelope:
    """The envelope in ``endpoint``; ``ProtocolError`` (naming ``who``) for anything else."""
    if not isinstance(endpoint, bytes | bytearray | memoryview):
        raise ProtocolError(f"{who}: an endpoint is bytes, not {type(endpoint).__name__}")
    try:
        return msgspec.msgpack.decode(endpoint, type=Envelope)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{who}: malformed endpoint: {exc}") from exc


def endpoint_address(endpoint: object) -> str:
    """The driver address an endpoint names (what its notifications and writes come from)."""
    return open_envelope(endpoint, "endpoint").address
