"""The two figures a driver declares for the staging cost model: defaults and the one check.

``Capabilities`` validates them when a driver declares them and ``stage`` when a
caller passes them; both word a bad value the same way, through these.
"""

from __future__ import annotations

DESCRIPTOR_BYTES = 4096
"""Default cost of one wire descriptor, in bytes the driver could have moved in its place."""

COPY_COST = 1.0
"""Default wire-byte equivalents of one locally copied byte: the driver's large-copy bandwidth
over the local copier's."""


def descriptor_bytes_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a ``descriptor_bytes`` (None: nothing)."""
    if type(value) is not int or value < 0:
        return f"descriptor_bytes must be an int >= 0, not {value!r}"
    return None


def copy_cost_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a ``copy_cost`` (None: nothing)."""
    if type(value) not in (int, float) or not 0 < value < 1e6:  # type: ignore[operator]
        return f"copy_cost must be a number in (0, 1e6), not {value!r}"
    return None
