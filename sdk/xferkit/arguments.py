"""Checks on what a caller passed: a wrong type is an ``ArgumentError``, whatever the module.

One place for them, so every public call words misuse the same way and no
domain error (``BoundsError``, ``RegistrationError``...) stands in for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import ArgumentError, XferError


def expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` when it is a ``kind``; else an ``ArgumentError`` naming ``what`` wanted it."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise ArgumentError(f"{what} takes a {names}, not {type(value).__name__} {value!r:.80}")
    return value


def seconds(value: object, what: str) -> float:
    """A caller's duration, checked: a bool or a string is an ``ArgumentError``, a negative
    number (or NaN) an ``XferError``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentError(f"{what} must be a number of seconds >= 0, not {value!r}")
    if not value >= 0:
        raise XferError(f"{what} must be a number of seconds >= 0, not {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int past a float's range
        why = f"{what} must be a number of seconds a float holds, not {value!r:.40}..."
        raise ArgumentError(why) from None


def items(value: object) -> tuple[Any, ...] | None:
    """``value``'s items when it is an iterable that yields them, else None: a 0-d array is
    ``Iterable``, and iterating it raises ``TypeError``."""
    if not isinstance(value, Iterable):
        return None
    try:
        return tuple(value)
    except TypeError:
        return None
