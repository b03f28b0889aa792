"""Test kit for engines and plugin authors: the reference model, its checkers and helpers.

``handoff(ref, request, write=...)`` runs a whole request against the
reference (plan, expand, check the descriptors, write, compare every byte);
``check_descriptors`` is the descriptor checker it uses; ``connected_pair``
(two backends, one connected to the other, both closed on the way out) and
``region`` (a region at a synthetic address) are the set-ups most tests need. The hypothesis
strategies (``layouts``, ``slot_requests``, ...) are imported on first use, so
the rest works without hypothesis installed.
"""

from typing import Any

from .checks import (
    Request,
    Writer,
    byte_runs,
    check_descriptors,
    for_rank,
    handoff,
    requested_bytes,
    staged_handoff,
)
from .models import gdn_hybrid
from .pairs import Pair, close_all, connected_pair
from .reference import (
    Rank,
    Reference,
    RegionSpec,
    WriteCounter,
    execute,
    held_indices,
    shard,
)
from .regions import region

_STRATEGIES = (
    "Layout",
    "Regions",
    "layouts",
    "manifest_regions",
    "msgpack_values",
    "region",
    "region_specs",
    "slot_pairs",
    "slot_requests",
    "tp_pairs",
    "wire_bytes",
)


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Layout",
    "Pair",
    "Rank",
    "Reference",
    "RegionSpec",
    "Regions",
    "Request",
    "WriteCounter",
    "Writer",
    "byte_runs",
    "check_descriptors",
    "close_all",
    "connected_pair",
    "execute",
    "for_rank",
    "gdn_hybrid",
    "handoff",
    "held_indices",
    "layouts",
    "manifest_regions",
    "msgpack_values",
    "region",
    "region_specs",
    "requested_bytes",
    "shard",
    "slot_pairs",
    "slot_requests",
    "staged_handoff",
    "tp_pairs",
    "wire_bytes",
]
