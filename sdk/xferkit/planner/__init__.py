"""Turn two manifests into the byte copies one source rank owes one destination rank.

Planning is pure and happens once per manifest pair: for every region key the
two sides share, it intersects what the source rank holds with what the
destination rank needs and keeps the part this source is designated to write
(a destination byte held by several source ranks is written by exactly one).
The result is a table of pieces within one slot. ``Plan.expand`` is the
per-request cost: it broadcasts that table over the request's slot pairs and
coalesces pieces contiguous on both sides, in numpy, with no per-slot loop.

Three jobs, three modules, behind this facade:

- ``pieces``: one region pair's geometry (``align``: the piece table, the page ratio);
- ``expand``: one request (``page_pairs``: the slots checked; ``expand_groups``: descriptors);
- ``coverage``: the proof that the sources together write each destination byte once.

``plan`` (pairing regions by key, grouping them) ties the first two into a ``Plan``.
"""

from .coverage import Coverage, coverage
from .expand import PagePairs, RegionGroup
from .pieces import MAX_PIECES, Alignment, Pieces
from .plan import Plan, plan

__all__ = [
    "MAX_PIECES",
    "Alignment",
    "Coverage",
    "PagePairs",
    "Pieces",
    "Plan",
    "RegionGroup",
    "coverage",
    "plan",
]
