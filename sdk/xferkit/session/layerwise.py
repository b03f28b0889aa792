"""Layer-wise writes: a chunk that names the layers it covers, written as the forward pass
finishes each, so the transfer of a layer overlaps the compute of the next.

``Send.write(slots, layers=...)`` writes only those layers' regions of the chunk's slots;
the same slots are written again for the other layers, in any grouping, and the pool's next
chunk starts once every layer of it was written once (``sends.Span``). The decode side
counts completions as for any write and unpacks a staged round of a layer set alone
(``wire.Round.layers``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ArgumentError
from ..manifest import Manifest


def check_layers(layers: object, manifest: Manifest, what: str) -> frozenset[int] | None:
    """``layers`` as a frozenset of this rank's layer ids (None: every layer)."""
    if layers is None:
        return None
    if isinstance(layers, str | bytes) or not isinstance(layers, Iterable):
        raise ArgumentError(f"{what}: layers is an iterable of layer ids, not {layers!r:.60}")
    out = set()
    for layer in layers:
        if type(layer) is not int:
            raise ArgumentError(f"{what}: layer ids are ints, not {layer!r:.40}")
        out.add(layer)
    if not out:
        raise ArgumentError(f"{what}: layers names no layer (leave it out to write them all)")
    unknown = sorted(out - manifest.layers)  # computed once per manifest
    if unknown:
        raise ArgumentError(f"{what}: layers {unknown[:8]} are not in this rank's manifest")
    return frozenset(out)


def pool_layers(manifest: Manifest) -> dict[str, frozenset[int]]:
    """The layers of each pool this rank holds: what a layer-wise chunk of it owes."""
    out: dict[str, set[int]] = {}
    for r in manifest.regions:
        out.setdefault(r.pool, set()).add(r.layer)
    return {pool: frozenset(layers) for pool, layers in out.items()}
