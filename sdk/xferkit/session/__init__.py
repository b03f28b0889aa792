"""The engine-facing Session: one per rank, requests as non-blocking handles.

See docs/engine.md for what an engine writes per rank and docs/protocol.md
for the messages on the wire.
"""

from .config import SessionConfig, load_config
from .handles import Receive, Send
from .keys import SessionKeys, keygen
from .session import Session, fingerprint
from .states import STAGES, PairEvent, RequestError, Routes, State
from .timeline import Span
from .wire import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "STAGES",
    "PairEvent",
    "Receive",
    "RequestError",
    "Routes",
    "Send",
    "Session",
    "SessionConfig",
    "SessionKeys",
    "Span",
    "State",
    "fingerprint",
    "keygen",
    "load_config",
]
