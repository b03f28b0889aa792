"""Test kit for engines and plugin authors: the reference model and its helpers.

The hypothesis strategies (``layouts``, ``slot_requests``, ...) are imported on
first use, so the reference model works without hypothesis installed.
"""

from typing import Any

from .models import gdn_hybrid
from .reference import (
    Rank,
    Reference,
    RegionSpec,
    WriteCounter,
    execute,
    held_indices,
    shard,
)

_STRATEGIES = (
    "Layout",
    "Regions",
    "layouts",
    "manifest_regions",
    "region_specs",
    "slot_pairs",
    "slot_requests",
    "tp_pairs",
)


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Layout",
    "Rank",
    "Reference",
    "RegionSpec",
    "Regions",
    "WriteCounter",
    "execute",
    "gdn_hybrid",
    "held_indices",
    "layouts",
    "manifest_regions",
    "region_specs",
    "shard",
    "slot_pairs",
    "slot_requests",
    "tp_pairs",
]
