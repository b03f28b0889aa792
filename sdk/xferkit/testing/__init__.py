"""Test kit for engines and plugin authors: the reference model and its helpers."""

from .reference import (
    Rank,
    Reference,
    RegionSpec,
    WriteCounter,
    execute,
    held_indices,
    shard,
)

__all__ = [
    "Rank",
    "Reference",
    "RegionSpec",
    "WriteCounter",
    "execute",
    "held_indices",
    "shard",
]
