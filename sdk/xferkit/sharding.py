"""What each tensor-parallel rank holds of a sharded axis.

The rule, shared by the manifest (to validate) and the planner (to slice):
along the sharded axis of global size G and TP size T, rank r holds
``[r*G//T, r*G//T + local)``; with shard groups ``(g1, g2, ...)`` the axis is a
concatenation of independently sharded blocks and rank r holds
``[off_j + r*g_j/T, off_j + (r+1)*g_j/T)`` of each, concatenated in order.
Replication (several ranks holding one index, as in GQA with more ranks than
KV heads) falls out of the first form when ``local*T > G``.
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """A run of the global axis held by one rank: global start, length, local start."""

    start: int
    length: int
    local: int


class AxisLayout(NamedTuple):
    """How one sharded axis is split over a TP group: enough to derive every rank's share."""

    size: int  # global size G
    local: int  # what each rank holds
    groups: tuple[int, ...]  # global group sizes; (G,) when ungrouped
    tp_size: int
    replicated: bool = False  # every rank holds the whole axis

    @property
    def whole(self) -> bool:
        """Every rank holds the axis in its global order, so grouping is irrelevant."""
        return self.replicated or self.tp_size == 1

    def segments(self, rank: int) -> tuple[Segment, ...]:
        if self.replicated:
            return (Segment(0, self.size, 0),)
        if len(self.groups) == 1:
            return (Segment(rank * self.size // self.tp_size, self.local, 0),)
        out = []
        offset = local = 0
        for g in self.groups:
            share = g // self.tp_size
            out.append(Segment(offset + rank * share, share, local))
            offset += g
            local += share
        return tuple(out)


MAX_GROUPS = 256
"""Most shard groups on one axis (a GDN conv state has 3): planning cost grows with them."""


def axis_layout(
    local: int,
    tp_size: int,
    groups: tuple[int, ...] | None,
    tp_global: int | None,
) -> AxisLayout:
    """The layout of a sharded axis, or ValueError saying which rule it breaks."""
    if groups is not None:
        if not groups or len(groups) > MAX_GROUPS or any(g <= 0 for g in groups):
            raise ValueError(f"tp_groups must be 1..{MAX_GROUPS} positive sizes, not {groups}")
        total = sum(groups)
        if tp_global is not None and tp_global != total:
            raise ValueError(f"tp_global {tp_global} differs from sum(tp_groups) {total}")
        bad = [g for g in groups if g % tp_size]
        if bad:
            raise ValueError(f"tp_groups {groups}: {bad} not divisible by tp_size {tp_size}")
        if total // tp_size != local:
            raise ValueError(
                f"tp_groups {groups} over tp_size {tp_size} give {total // tp_size} "
                f"per rank, but the local axis has {local}"
            )
        return AxisLayout(total, local, tuple(groups), tp_size)
    size = local * tp_size if tp_global is None else tp_global
    if size <= 0 or local <= 0 or local > size:
        raise ValueError(f"local size {local} cannot be a share of global size {size}")
    # Rank r starts at floor(r*G/T): consecutive starts differ by at most ceil(G/T), and
    # the last rank must end at G. Both hold exactly when local == ceil(G/T): checked in
    # closed form, so a huge TP size claimed by a peer costs nothing.
    want = -(-size // tp_size)
    if local != want:
        last = (tp_size - 1) * size // tp_size
        what = (
            f"rank {tp_size - 1} would hold [{last}, {last + local})"
            if local > want
            else f"leaves gaps: each rank needs {want}"
        )
        raise ValueError(f"global size {size} over tp_size {tp_size} with {local} per rank: {what}")
    return AxisLayout(size, local, (size,), tp_size)
