"""One request across a TP group: when its shared pages are safe to free, and who failed first.

An engine whose pages are shared by the TP ranks of a group (each rank moves
its own shard of the same slots) may free them only once *every* rank's handle
is terminal: one rank FAILED while another still transfers means bytes may
still land. And the root cause to report is the first failure, whichever rank
saw it. Each rank summarizes its handle in four int64s, the group all-reduces
them with MIN (``torch.distributed.all_reduce(t, op=ReduceOp.MIN)``, or any
collective), and every rank reads the same verdict::

    mine = xferkit.group.summarize([recv])          # int64 [1, 4]; many requests: one row each
    reduced = mine.copy(); all_reduce_min(reduced)  # the engine's collective
    (g,) = xferkit.group.read(reduced)
    if g.safe_to_free: free(slots)
    if g.failed and xferkit.group.first_failure(mine, reduced)[0]: report(recv.error)

Columns: ``terminal`` (1 when DONE or FAILED), ``clean`` (0 once the request is
known to fail, draining or FAILED), ``progress`` (the state's place in
HANDSHAKING < WAITING < TRANSFERRING < DONE; a failed handle counts as done
progressing), ``failed_at`` (wall-clock microseconds when this rank's handle
FAILED, or, while it still drains, when it was summarized; ``NEVER`` without
a failure): MIN gives all-terminal, any-failure, the least advanced rank and
the earliest failure at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arguments import items
from .errors import ArgumentError
from .session import State

NEVER = np.iinfo(np.int64).max
"""``failed_at`` of a rank whose request has not failed."""
PROGRESS = (State.HANDSHAKING, State.WAITING, State.TRANSFERRING, State.DONE)
COLUMNS = ("terminal", "clean", "progress", "failed_at")


@dataclass(frozen=True, slots=True)
class GroupState:
    """The group's verdict on one request (the same on every rank after the all-reduce)."""

    state: State  # DONE or FAILED once every rank is terminal, else the least advanced rank's
    failed: bool  # some rank knows the request fails (it may still drain)
    safe_to_free: bool  # every rank is terminal: no byte of the request can land any more
    failed_at: int  # wall-clock microseconds of the first failure (NEVER without one)


def summarize(handles: Iterable[Any]) -> np.ndarray:
    """This rank's row per handle (``Receive`` or ``Send``): an int64 array ``[n, 4]``."""
    rows = []
    given = items(handles)
    if given is None:
        raise ArgumentError(f"summarize() takes request handles, not {handles!r:.80}")
    for h in given:
        try:
            state, failing, times = h.poll(), h.failing, h.times
        except AttributeError:
            state = times = None
        if not isinstance(state, State) or not isinstance(times, Mapping):
            raise ArgumentError(f"summarize() takes request handles, not {h!r:.80}")
        terminal = state in (State.DONE, State.FAILED)
        progress = PROGRESS.index(State.DONE if state is State.FAILED else state)
        failed_at = NEVER
        if failing is not None:  # when it was learned, on this host's wall clock
            seen = times.get(State.FAILED, time.monotonic())
            failed_at = int((time.time() - (time.monotonic() - seen)) * 1e6)
        rows.append((int(terminal), int(failing is None), progress, failed_at))
    return np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))


def _rows(value: object, what: str) -> np.ndarray:
    """``value`` as summary rows ``[n, 4]`` of int64, or an ArgumentError naming ``what``."""
    try:
        rows = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        rows = np.empty((0, 0), dtype=np.int64)
    if rows.ndim not in (1, 2) or rows.shape[-1] != len(COLUMNS):
        raise ArgumentError(f"{what}: rows of {len(COLUMNS)} int64s {COLUMNS}, not {value!r}")
    return rows.reshape(-1, len(COLUMNS))


def reduce(rows: Sequence[np.ndarray]) -> np.ndarray:
    """What an all-reduce with MIN computes from every rank's ``summarize`` (for tests and
    for engines that gather instead)."""
    ranks = [_rows(r, "reduce()") for r in rows] if isinstance(rows, Sequence) else []
    if not ranks or len({r.shape for r in ranks}) != 1:
        raise ArgumentError(f"reduce() takes one summary per rank, all of one shape: {rows!r}")
    return np.minimum.reduce(ranks)


def read(reduced: np.ndarray) -> list[GroupState]:
    """The group's verdict per request, from the reduced rows."""
    out = []
    for terminal, clean, progress, failed_at in _rows(reduced, "read()").tolist():
        if not 0 <= progress < len(PROGRESS):
            raise ArgumentError(f"read(): progress {progress} is no state (0..{len(PROGRESS) - 1})")
        done = bool(terminal)  # else some rank is short of DONE: progress < DONE's
        state = (State.FAILED if not clean else State.DONE) if done else PROGRESS[progress]
        out.append(GroupState(state, not clean, done, failed_at))
    return out


def first_failure(mine: np.ndarray, reduced: np.ndarray) -> np.ndarray:
    """Per request, whether this rank saw the group's first failure (its root cause is the one
    to report); ties (the same microsecond) make several ranks say so."""
    own, first = _rows(mine, "first_failure()")[:, 3], _rows(reduced, "first_failure()")[:, 3]
    if own.shape != first.shape:
        raise ArgumentError(
            "first_failure(): this rank's rows and the reduced ones differ in count"
        )
    return np.asarray((own == first) & (first != NEVER))
