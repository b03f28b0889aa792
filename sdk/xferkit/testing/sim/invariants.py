"""The invariants, checked as the schedule runs (the numbers are docs/reliability.md's).

1. No byte lands in memory its owner did not offer for that request at that moment, and no
   source byte is read after its request is terminal there.
2. Every request is terminal within ``Config.bound_s`` of its first call, whatever the faults.
3. DONE on a decode rank means its every destination byte holds the source's bytes.
4. A handle is reported once by ``progress()`` (``Finished``); states only move forward.
5. A failed request's root cause is never replaced, and one that names the rank where it
   happened is that rank's own (ranks that fail independently at once may differ; an id
   used again may be told an earlier use's root cause: ids are single-use).
6. Every table stays within its documented bound.
7. A third peer's messages fail a request on a prefill rank only where its own Request
   reached that rank before an honest decode rank held the place it claims (claiming first
   is the documented limit of a peer that holds a trusted key).

3 also covers outcomes: when every rank of one side is DONE, a rank of the other side fails
only through a race the engine can tell by its stage (``RACES``), never a transfer, plan,
request or handshake error.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...descriptors import Descriptors
from ...session import actions as act
from ...session import wire
from ...session.core import MAX_EARLY, MAX_PAIRS, REMEMBERED
from ...session.protocol import CUT_ALL
from ...session.states import State
from .hostile import FORGED, HOSTILE

if TYPE_CHECKING:
    from .driver import Write
    from .engine import Handle, Use
    from .world import Rank, World

    Member = tuple[wire.Join, bytes, float]  # a roster place: the Join, its identity, when


RACES = frozenset({"abort", "timeout", "peer lost", "closed"})
"""Stages by which one side may fail a request the other side finished (an abort, a deadline
or a loss racing the completion)."""
FIRST_RANK = re.compile(r"\(([PQRDEF]\d+)\)")
"""The first rank a text names: where a failure began."""
ORIGIN = re.compile(r" at (?:prefill|decode) rank \d+ \(([^)]+)\): ")
"""Where a root-cause text says it happened (``core.stage_text``)."""


@dataclass(frozen=True)
class Violation:
    seed: int
    step: int
    now: float
    invariant: int
    what: str

    def __str__(self) -> str:
        return (
            f"seed {self.seed} step {self.step} t={self.now:.6f}: invariant {self.invariant}: "
            f"{self.what}"
        )


class Checker:
    def __init__(self, world: World) -> None:
        self.w = world
        self.violations: list[Violation] = []
        self._open: list[tuple[float, int, Handle]] = []  # (must end by, serial, handle)
        self._n = 0
        self.outcomes: dict[str, int] = {}
        self.joins: dict[tuple[str, tuple[int, int]], float] = {}  # honest members' last Join

    def violate(self, invariant: int, what: str) -> None:
        w = self.w
        self.violations.append(Violation(w.seed, w.steps, w.now, invariant, what))

    # -- 1: writes ----------------------------------------------------------------------

    def landing(self, wr: Write, descs: Descriptors, late: bool, released: bool = False) -> None:
        """``released``: a write its driver let go of, whose bytes still go out (its ends are
        not final): its source reads are not checked. The prefill's engine may reuse those
        slots at FAILED while the transport still sends from them; what it sends lands in
        the failed request's slots, before the decode rank's FAILED (invariant 1 there)."""
        dec, pre = self.w.ranks[wr.peer[1]], self.w.ranks[wr.pre]
        tag = wr.tag
        key = ("", -1) if tag is None else (tag.rid, tag.gen)
        serial = dec.memory.serials.get(key, -1)
        how = " (landing after its write was reported ended)" if late else ""
        staged = dec.memory.in_staging(descs.dst)
        slots = ~staged
        bad = dec.memory.foreign(descs.dst[slots], descs.nbytes[slots], serial)
        if staged.any():
            bad = bad or dec.memory.foreign_staging(descs.dst[staged], descs.nbytes[staged], key)
        if bad is not None:
            self.violate(
                1,
                f"a write of {key[0]!r} (use {serial}) from {pre.name} landed in {dec.name}'s "
                f"{bad}{how}",
            )
        read = ~pre.memory.in_staging(descs.src)  # its own staging is its core's to manage
        bad = None if released else pre.memory.foreign(descs.src[read], descs.nbytes[read], serial)
        if bad is not None:
            self.violate(
                1,
                f"a write of {key[0]!r} (use {serial}) to {dec.name} read {pre.name}'s {bad}{how}",
            )

    # -- 3, 4, 5: what handles are told -------------------------------------------------

    def told(self, rank: Rank, a: act.Action) -> Handle | None:
        if isinstance(a, act.Finished):
            mine = [h for h in rank.handles if h.request_id == a.rid and h.terminal]
            fresh = [h for h in mine if h.finished == 0]
            if not fresh:
                self.violate(4, f"{rank.name} reported {a.rid!r} finished again (or never open)")
            else:
                fresh[0].finished += 1
                rank.handles.discard(fresh[0])
            return None
        h: Handle = a.handle  # type: ignore[union-attr]
        if h.rank != rank.name or h.inc != rank.incarnation:
            self.violate(4, f"{rank.name} told a handle of {h.rank}#{h.inc}: {a!r}"[:300])
            return None
        if h.terminal:
            self.violate(
                4,
                f"{rank.name}: {type(a).__name__} after {h.states[-1].name} for "
                f"{h.request_id!r} (use {h.use.serial})",
            )
            return None
        if isinstance(a, act.Move):
            if a.state < h.states[-1]:
                self.violate(
                    4,
                    f"{rank.name}: {h.request_id!r} moved back from "
                    f"{h.states[-1].name} to {a.state.name}",
                )
            h.states.append(a.state)
            return None
        if isinstance(a, act.Failing):
            self._hostile(rank, h, a.error)
            if h.failing is not None and h.failing.args != a.error.args:
                self.violate(
                    5,
                    f"{rank.name}: {h.request_id!r}'s root cause was replaced: "
                    f"{h.failing} -> {a.error}",
                )
            h.failing = h.failing or a.error
            return None
        if isinstance(a, act.Failed):
            if h.failing is None:
                self._hostile(rank, h, a.error)
            if h.failing is not None and h.failing.args != a.error.args:
                self.violate(
                    5,
                    f"{rank.name}: {h.request_id!r} failed with {a.error}, "
                    f"not its root cause {h.failing}",
                )
            h.error = a.error
            h.states.append(State.FAILED)
        else:
            h.states.append(State.DONE)
            if h.side == "decode" and not self.asked_hostile(h.use):  # a source it named may lie
                self._exact(rank, h)
        self._settled(h.use)
        return h

    def asked_hostile(self, use: Use) -> bool:
        """The decode ranks asked the hostile prefill for ``use`` (a decoy, or its group's
        roster named it): what a source a request names says it wrote is that source's word."""
        hostile = self.w.hostile
        return use.decoy or (hostile is not None and use.serial in hostile.asked)

    def _hostile(self, rank: Rank, h: Handle, error: Exception) -> None:
        text = str(error)
        if h.use.reused or self.asked_hostile(h.use) or HOSTILE not in text:
            return
        if self.w.config.fence_cuts_all and CUT_ALL in text:
            return  # a fence for the lost hostile prefill, which a request asked, cut every pair
        if h.side == "decode":  # the hostile prefill's messages: for what it was asked only
            if FORGED in text and not any(
                HOSTILE in self.w.claims.get((p, h.request_id), ()) for p in self.w.prefill
            ):
                self.violate(
                    7,
                    f"{rank.name}: the hostile prefill failed {h.request_id!r} (use "
                    f"{h.use.serial}), which never named it: {error}",
                )
            return
        first = FIRST_RANK.search(text)
        if first is not None and first.group(1) != rank.name:
            return  # a consequence: checked where it began
        # A text it made up names no rank: it may have come from wherever it claimed first.
        where = [rank.name] if first is not None else self.w.prefill
        if not any(HOSTILE in self.w.claims.get((p, h.request_id), ()) for p in where):
            self.violate(
                7,
                f"{rank.name}: the hostile peer failed {h.request_id!r} (use "
                f"{h.use.serial}), where it claimed no place first: {error}",
            )

    def _exact(self, rank: Rank, h: Handle) -> None:
        use = h.use
        index = use.decode.index(rank.name)
        ref = self.w.refs[self.w.decodes.index(use.decode)]
        # The decode holds the first ``skip`` KV pages: its slots hold the source's after them.
        pairs = {p: (use.src[p][use.skip if p == "kv" else 0 :], use.dst[p]) for p in use.dst}
        want = ref.expected(index, pairs)
        for key, array in rank.memory.arrays.items():
            slots = use.dst.get(key[0])
            if slots is None:
                continue
            got, exp = array[slots], want[key][slots]
            if not np.array_equal(got, exp):
                where = np.argwhere(got != exp)[0]
                self.violate(
                    3,
                    f"{rank.name} said DONE for {use.rid!r} (use {use.serial}) but "
                    f"{key} slot {slots[int(where[0])]} differs from the source",
                )
                return

    def _settled(self, use: Use) -> None:
        hs = list(use.handles.values())
        if use.decoy or not all(h.terminal for h in hs):
            return
        if len(hs) < len(use.prefill) + len(use.decode):
            return
        done = {h.side for h in hs if h.states[-1] is State.DONE}
        failed = [h for h in hs if h.states[-1] is State.FAILED]
        key = "done" if not failed else "failed" if not done else "mixed"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        hijacked = self.asked_hostile(use) or any(
            HOSTILE in self.w.claims.get((p, use.rid), ()) for p in self.w.prefill
        )
        for side in () if hijacked else ("prefill", "decode"):  # (a place it claimed first)
            if all(h.states[-1] is State.DONE for h in hs if h.side == side):
                for h in failed:
                    if h.side != side and h.error is not None and h.error.stage not in RACES:
                        self.violate(
                            3,
                            f"every {side} rank said DONE for {use.rid!r} (use "
                            f"{use.serial}) but {h.rank} failed: {h.error}",
                        )
        if use.reused or hijacked:  # ids are single-use: it may read an earlier use's root
            return  # cause; and one the hostile peer claimed first may read its
        for h in failed:  # a root cause naming another rank is that rank's own
            named = ORIGIN.search(h.error.args[0]) if h.error is not None else None
            origin = use.handles.get(named.group(1)) if named else None
            if origin is None or origin is h or origin.error is None or h.error is None:
                continue
            if self.w.ranks[origin.rank].incarnation != origin.inc:
                continue  # the text may be its next incarnation's, which never had the request
            if "wait for offer() here" in h.error.args[0]:
                continue  # a Request refused for a bound leaves nothing behind to remember
            if origin.error.args[0] != h.error.args[0]:
                self.violate(
                    5,
                    f"{h.rank} reports {use.rid!r} (use {use.serial}) failed with "
                    f"{h.error}, which names {origin.rank}, but {origin.rank} "
                    f"reports {origin.error}",
                )

    # -- 2, 6: after every step ---------------------------------------------------------

    def opened(self, h: Handle) -> None:
        self._n += 1
        heapq.heappush(self._open, (h.began + self.w.config.bound_s, self._n, h))

    def step(self) -> None:
        while self._open:
            due, _, h = self._open[0]
            rank = self.w.ranks[h.rank]
            if h.terminal or rank.incarnation != h.inc or not rank.alive:
                heapq.heappop(self._open)
            elif self.w.now > due:
                heapq.heappop(self._open)
                self.violate(
                    2,
                    f"{h.rank}: {h.request_id!r} (use {h.use.serial}) still "
                    f"{h.states[-1].name} {self.w.now - h.began:.1f} s after it began "
                    f"(bound {self.w.config.bound_s:.0f} s)",
                )
            else:
                break

    def bounds(self, rank: Rank) -> None:
        p = rank.proto
        ledger = p.outgoing.ledger
        open_here = len(rank.handles)
        for name, size, bound in (
            ("pairs.downs", len(p.pairs.downs), MAX_PAIRS),
            ("outgoing.sends", len(p.outgoing.sends), ledger.max_unoffered + open_here),
            ("ledger.finished", len(ledger.finished), REMEMBERED),
            ("ledger.failed", len(ledger.failed), REMEMBERED),
            ("ledger.early", len(ledger.early), MAX_EARLY),
            ("incoming.recvs", len(p.incoming.recvs), open_here),
            ("outgoing.writes", len(p.outgoing.writes), 64 * (open_here + 1)),
        ):
            if size > bound:
                self.violate(6, f"{rank.name}: {name} holds {size} (bound {bound})")
        for down in p.pairs.downs.values():  # row 10: what a refused Hello brought is not kept
            if down.error is not None and (down.plan is not None or down.staged is not None):
                self.violate(6, f"{rank.name}: the refused pair of {down.where()} keeps its plan")
        for up in p.pairs.ups.values():  # a driver's notifications count for its own pair
            if up.welcome is not None and p.pairs.by_driver.get(up.driver_name) is not up:
                other = p.pairs.by_driver.get(up.driver_name)
                self.violate(
                    7,
                    f"{rank.name}: notifications from {up.driver_name}, the driver of its live "
                    f"pair with {up.address}, count for {other.address if other else 'nobody'}",
                )

    def connects(self, rank: Rank, actions: list[act.Action]) -> None:
        """The driver connects (a thread, a socket, a pidfd) only for a Hello the core kept:
        refused work leaves nothing behind, whatever a peer sends."""
        for a in actions:
            if isinstance(a, act.Connect):
                down = rank.proto.pairs.downs.get(a.key)
                error = None if down is None else down.error
                if down is None or error is not None:
                    why = "none kept" if error is None else error[1]
                    self.violate(6, f"{rank.name} connects its driver for a refused Hello: {why}")

    def joined(self, rank: Rank, ident: bytes, msg: wire.Join, held: Member | None) -> None:
        """A ``Join`` reached the rank serving the group: a place outside the group is never
        held, and one a live member holds never changes hands."""
        p, key, now = rank.proto, (msg.tp_rank, msg.pp_rank), rank.local(self.w.now)
        got = p.roster.members.get(key)
        if not ident.startswith(HOSTILE.encode()):  # an honest member
            if got is not None and got[1] == ident:  # the member holding the place is live
                self.joins[rank.name, key] = now
            return
        if got is None or got[1] != ident:
            return
        tp, pp = p.s.manifest.tp_size, p.s.pp_size
        if key[0] >= tp or key[1] >= pp:
            self.violate(6, f"{rank.name}'s roster holds (TP, PP) {key}, outside TP {tp} x PP {pp}")
        last = self.joins.get((rank.name, key))
        if (
            held is not None
            and held[1] != ident
            and last is not None
            and now - last <= p.s.dead_after_s
        ):
            self.violate(
                7,
                f"{rank.name}'s roster gave {held[0].address}'s place {key} to the hostile "
                f"peer {now - last:.1f} s after that member's last Join",
            )

    def quiet(self) -> bool:
        """True once the schedule has nothing left to show: a violation, or every request
        settled and every fault played out."""
        if self.violations:
            return True
        e = self.w.engine
        return (
            self.w.now > self.w.config.arrivals_s + 25.0
            and len(e.uses) >= self.w.config.requests
            and all(len(u.freed) == 2 for u in (*e.uses, *e.decoys))
        )

    def finish(self) -> None:
        if self.violations:
            return
        for u in (*self.w.engine.uses, *self.w.engine.decoys):
            for h in u.handles.values():
                rank = self.w.ranks[h.rank]
                if not h.terminal and rank.incarnation == h.inc and rank.alive:
                    self.violate(
                        2,
                        f"{h.rank}: {h.request_id!r} (use {u.serial}) still "
                        f"{h.states[-1].name} when the schedule ended",
                    )
                    return
        if not self.w.config.faults:  # nothing went wrong, so nothing may fail
            for u in self.w.engine.uses:
                for h in u.handles.values():
                    if h.states[-1] is not State.DONE:
                        self.violate(
                            8,
                            f"{h.rank}: {h.request_id!r} (use {u.serial}) ended "
                            f"{h.states[-1].name} in a schedule without faults",
                        )
                        return
        if len(self.w.engine.uses) < self.w.config.requests:
            self.violate(
                2,
                f"only {len(self.w.engine.uses)} of {self.w.config.requests} "
                "requests began: slots never came back",
            )
