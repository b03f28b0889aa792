"""What an engine passes to a Session call that names requests and their sources, checked on
the engine's thread before anything is queued."""

from __future__ import annotations

from ..arguments import items
from ..errors import XferError


def request_id(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 256 or not utf8(value):
        raise XferError(f"a request id is a str of 1..256 characters, not {value!r}")
    return value


def utf8(text: str) -> bool:
    """Whether ``text`` travels (a lone surrogate does not encode: the control thread died on
    the first message naming it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def sources(source: object, call: str) -> tuple[str, ...]:
    """Session or group addresses: one, or an iterable of distinct ones."""
    if isinstance(source, str) and source and utf8(source):  # the common case, first
        return (source,)
    raw = (source,) if isinstance(source, str) else source
    out = items(raw) or ()
    if not out or not all(isinstance(s, str) and s and utf8(s) for s in out):
        raise XferError(f"{call}(source=) takes session or group addresses, not {source!r}")
    if len(set(out)) != len(out):
        raise XferError(f"{call}(source=) names an address twice: {out}")
    return out
