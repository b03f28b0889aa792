"""Regions at synthetic addresses, for tests of manifests and plans (which never dereference).

One factory with the fields tests vary most; a test module fixes its own
defaults with ``functools.partial(region, slots=8, ...)``.
"""

from __future__ import annotations

import math
from typing import Any

from ..manifest import Region

_GAP = 0x100  # between fresh addresses: neighbours never touch
_cursor = [0x10000]
FRESH: Any = object()
"""``region(addr=FRESH)`` (the default): a fresh address (any other value passes through)."""


def fresh_address(nbytes: int) -> int:
    """An address no earlier ``fresh_address`` range overlaps or touches (never mapped)."""
    addr = _cursor[0]
    _cursor[0] += max(nbytes, 1) + _GAP
    return addr


def region(
    name: str = "k",
    layer: int = 0,
    *,
    pool: str = "kv",
    part: int = 0,
    addr: Any = FRESH,
    slots: int = 4,
    slot_shape: tuple[int, ...] = (2, 8),
    itemsize: int = 2,
    nbytes: int | None = None,
    **fields: Any,
) -> Region:
    """A region of ``slots`` slots of ``slot_shape`` items at ``addr`` (default: a fresh one);
    ``nbytes`` overrides the size the slots give; other ``Region`` fields pass through."""
    size = slots * math.prod(slot_shape) * itemsize if nbytes is None else nbytes
    return Region(
        pool=pool,
        name=name,
        layer=layer,
        part=part,
        addr=fresh_address(size) if addr is FRESH else addr,
        nbytes=size,
        slot_shape=slot_shape,
        itemsize=itemsize,
        **fields,
    )
