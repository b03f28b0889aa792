"""Mooncake's return codes, named as in its ``include/error.h``: the one place they become errors.

The Python bindings report every outcome as an int. Registration calls return
these codes as they are; the transfer calls collapse every failure to -1 and
leave the reason in the engine's log (glog, on stderr). Each code maps to its
name, what it means here, and the xferkit error it is raised as.
"""

from __future__ import annotations

from xferkit.driver import (
    OptionError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)

_ENGINE = {
    -200: ("ERR_METADATA", "metadata error"),
    -201: ("ERR_ENDPOINT", "endpoint error"),
    -202: ("ERR_CONTEXT", "device context error"),
    -300: ("ERR_NUMA", "NUMA error"),
    -301: ("ERR_CLOCK", "clock error"),
    -302: ("ERR_MEMORY", "memory error"),
    -303: ("ERR_NOT_IMPLEMENTED", "not implemented"),
}

CODES: dict[int, tuple[str, str, type[XferError]]] = {
    -1: ("ERR_INVALID_ARGUMENT", "invalid argument", XferError),
    -2: ("ERR_TOO_MANY_REQUESTS", "too many requests", TransferError),
    -3: (
        "ERR_ADDRESS_NOT_REGISTERED",
        "the address is not registered with this engine",
        RegistrationError,
    ),
    -4: ("ERR_BATCH_BUSY", "the batch is busy", TransferError),
    -6: ("ERR_DEVICE_NOT_FOUND", "no such device", OptionError),
    -7: (
        "ERR_ADDRESS_OVERLAPPED",
        "Transfer Engine does not support overlapped memory region "
        "(the range overlaps memory this engine already registered)",
        RegistrationError,
    ),
    -8: ("ERR_NOT_LOCAL_SEGMENT_OR_SHM", "not the local segment or shared memory", XferError),
    # Reaching a peer: its address, its handshake.
    -101: ("ERR_DNS", "the peer's host name does not resolve", TransferError),
    -102: ("ERR_SOCKET", "socket error: the peer's handshake port is unreachable", TransferError),
    -103: ("ERR_MALFORMED_JSON", "malformed handshake JSON", ProtocolError),
    -104: ("ERR_REJECT_HANDSHAKE", "the peer rejected the handshake", ProtocolError),
    # The engine itself (its set-up, its host): nothing the caller's request can change.
    **{code: (*row, PluginError) for code, row in _ENGINE.items()},
}
_UNKNOWN = ("not in Mooncake error.h", "unknown code", XferError)


def code_name(rc: int) -> str:
    """``-7 (ERR_ADDRESS_OVERLAPPED)``."""
    return f"{rc} ({CODES.get(rc, _UNKNOWN)[0]})"


def explain(rc: int, registering: bool = False) -> str:
    """``-7 (ERR_ADDRESS_OVERLAPPED: ...)``: the code with Mooncake's name and meaning."""
    label, text, _ = CODES.get(rc, _UNKNOWN)
    if registering and rc == -1:
        text = "invalid argument, e.g. a zero-length region"
    return f"{rc} ({label}: {text})"


def explain_transfer(rc: int) -> str:
    """A transfer call's code: they return -1 for every failure, the reason goes to the log."""
    if rc == -1:
        return "-1 (Mooncake's transfer calls return -1 for every failure)"
    return explain(rc)


def check(rc: int, call: str, registering: bool = False) -> None:
    """Raise the xferkit error ``rc`` maps to, naming ``call``; return when it is 0."""
    if rc != 0:
        raise CODES.get(rc, _UNKNOWN)[2](f"Mooncake {call} returned {explain(rc, registering)}")
