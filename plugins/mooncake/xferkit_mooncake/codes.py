"""Mooncake's return codes, named as in its ``include/error.h``, with what each means here.

The Python bindings report every outcome as an int. Registration calls return
these codes as they are; the transfer calls collapse every failure to -1 and
leave the reason in the engine's log (glog, on stderr).
"""

from __future__ import annotations

CODES: dict[int, tuple[str, str]] = {
    -1: ("ERR_INVALID_ARGUMENT", "invalid argument"),
    -2: ("ERR_TOO_MANY_REQUESTS", "too many requests"),
    -3: ("ERR_ADDRESS_NOT_REGISTERED", "the address is not registered with this engine"),
    -4: ("ERR_BATCH_BUSY", "the batch is busy"),
    -6: ("ERR_DEVICE_NOT_FOUND", "no such device"),
    -7: (
        "ERR_ADDRESS_OVERLAPPED",
        "Transfer Engine does not support overlapped memory region "
        "(the range overlaps memory this engine already registered)",
    ),
    -8: ("ERR_NOT_LOCAL_SEGMENT_OR_SHM", "not the local segment or shared memory"),
    -101: ("ERR_DNS", "the peer's host name does not resolve"),
    -102: ("ERR_SOCKET", "socket error: the peer's handshake port cannot be reached"),
    -103: ("ERR_MALFORMED_JSON", "malformed handshake JSON"),
    -104: ("ERR_REJECT_HANDSHAKE", "the peer rejected the handshake"),
    -200: ("ERR_METADATA", "metadata error"),
    -201: ("ERR_ENDPOINT", "endpoint error"),
    -202: ("ERR_CONTEXT", "device context error"),
    -300: ("ERR_NUMA", "NUMA error"),
    -301: ("ERR_CLOCK", "clock error"),
    -302: ("ERR_MEMORY", "memory error"),
    -303: ("ERR_NOT_IMPLEMENTED", "not implemented"),
}


def code_name(rc: int) -> str:
    """``-7 (ERR_ADDRESS_OVERLAPPED)``."""
    return f"{rc} ({CODES.get(rc, ('not in Mooncake error.h', ''))[0]})"


def explain(rc: int, registering: bool = False) -> str:
    """``-7 (ERR_ADDRESS_OVERLAPPED: ...)``: the code with Mooncake's name and meaning."""
    if registering and rc == -1:
        label, text = "ERR_INVALID_ARGUMENT", "invalid argument, e.g. a zero-length region"
    else:
        label, text = CODES.get(rc, ("not in Mooncake error.h", "unknown code"))
    return f"{rc} ({label}: {text})"


def explain_transfer(rc: int) -> str:
    """A transfer call's code: they return -1 for every failure, the reason goes to the log."""
    if rc == -1:
        return "-1 (Mooncake's transfer calls return -1 for every failure)"
    return explain(rc)
