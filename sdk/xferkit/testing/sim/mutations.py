"""Defects put back into the protocol core, one at a time, to show the simulator finds each.

Each ``Mutation`` edits the source of one or more methods (the defect as it was, or a
classic one) and swaps the edited functions in for the duration of ``applied()``.
``hunt`` runs seeded schedules under it until a violation shows; how many schedules that
took is the simulator's power against that defect (docs/reliability.md, the table).
Defects the simulator does not model (sockets, the garbage collector, memory held per
message) are listed in ``OUTSIDE`` with where they are tested instead.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from unittest import mock

from ...session.incoming import Incoming
from ...session.outgoing import Outgoing
from ...session.pairs import Pairs
from ...session.protocol import Protocol
from ...session.roster import Roster
from ...session.rounds import Outbound
from ...session.sends import Dst, Ledger, Span
from ...session.unpacking import Unpacker
from . import run
from .config import FAULTS, Config
from .invariants import Violation


@dataclass(frozen=True)
class Edit:
    target: type
    method: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    defect: str  # what it puts back (a row of docs/reliability.md, or a classic)
    edits: tuple[Edit, ...]
    faults: frozenset[str] = FAULTS  # the schedules that may show it
    config: tuple[tuple[str, object], ...] = ()  # and their shape, over ``Config()``

    @contextmanager
    def applied(self) -> Iterator[None]:
        with ExitStack() as stack:
            for e in self.edits:
                func = getattr(e.target, e.method)
                source = textwrap.dedent(inspect.getsource(func))
                if source.count(e.old) != 1:
                    raise ValueError(
                        f"{self.name}: {e.target.__name__}.{e.method} no longer "
                        f"holds {e.old!r} once"
                    )
                line = source[: source.index(e.old)].rsplit("\n", 1)[-1]  # its indentation
                mutant = source.replace(e.old, e.new.replace("\n", "\n" + line))
                code = compile(mutant, inspect.getsourcefile(func) or "?", "exec")
                space: dict[str, object] = {}
                exec(code, func.__globals__, space)  # the mutant, on purpose
                stack.enter_context(mock.patch.object(e.target, e.method, space[e.method]))
            yield


MUTATIONS = (
    Mutation(
        "abort-any-place",
        "1: an Abort or Fail acts on any place, not only the one its connection claimed",
        (
            Edit(
                Outgoing,
                "remote_fail",
                "if rec is None or dst is None or dst.gen != msg.gen:",
                "if rec is None:",
            ),
        ),
    ),
    Mutation(
        "fail-poisons-offer",
        "2: a bare Fail for an id not offered yet fails the later offer",
        (
            Edit(
                Outgoing,
                "remote_fail",
                "if rec is None or dst is None or dst.gen != msg.gen:",
                "if rec is None and isinstance(msg, wire.Fail):\n"
                "    self._early_failure(msg.rid, RequestError(msg.text, stage=msg.stage,"
                " request_id=msg.rid))\n"
                "    return\n"
                "if rec is None or dst is None or dst.gen != msg.gen:",
            ),
        ),
        config=(("hostile_acts", 24),),  # Fails for the next ids, before anyone asks
    ),
    Mutation(
        "any-source-fails",
        "3: a Fail or AbortAck counts from a prefill rank the request never named",
        (
            Edit(
                Incoming,
                "_concerned",
                "if rec is None or rec.gen != msg.gen or up.address not in rec.requested:",
                "if rec is None or rec.gen != msg.gen:",
            ),
        ),
        config=(("hostile_acts", 24),),  # the hostile prefill forges more
    ),
    Mutation(
        "welcome-of-a-live-pair",
        "6: a Welcome naming a driver address a live pair holds takes its completions",
        (
            Edit(
                Pairs,
                "welcome",
                "if driver == self.driver_name or (holder is not None and holder is not up):",
                "if driver == self.driver_name:",
            ),
        ),
        FAULTS | {"impersonate"},
    ),
    Mutation(
        "endpoint-of-a-live-pair",
        "4, 5: a Hello naming a live pair's endpoint is accepted",
        (
            Edit(
                Pairs,
                "hello",
                "if driver == self.driver_name or holder is not None:",
                "if driver == self.driver_name:",
            ),
        ),
        FAULTS | {"impersonate"},
    ),
    Mutation(
        "trust-declared-driver",
        "classic: the driver address a Hello declares is believed, not its endpoint's",
        (
            Edit(
                Pairs,
                "hello",
                'driver = f"{msg.backend}:{endpoint_address(msg.endpoint)}"',
                'driver = f"{msg.backend}:{msg.driver_address}"',
            ),
        ),
        FAULTS | {"impersonate"},
    ),
    Mutation(
        "failed-before-the-fence",
        "7: FAILED is said at once, not after the sources' AbortAck",
        (
            Edit(
                Incoming,
                "fail",
                "rec.drain_until = now + drain + self.s.dead_after_s",
                "rec.drain_until = now + drain + self.s.dead_after_s\nrec.acks.clear()",
            ),
        ),
    ),
    Mutation(
        "no-pause-check",
        "8: a prefill rank that was stopped past dead_after_s writes on",
        (
            Edit(
                Protocol,
                "_enter",
                "if last is not None and now - last > self._paused_s and self.pairs.downs:",
                "if False:",
            ),
        ),
        config=(("max_pause_s", 40.0),),  # past the drain bound by more
    ),
    Mutation(
        "failed-before-fenced",
        "3 (fencing): FAILED is said when the fence is asked for, not once the driver fenced",
        (
            Edit(
                Incoming,
                "pair_lost",
                "self.out.add(act.Fence(up.driver_name))",
                "self.out.add(act.Fence(up.driver_name))\nself._stopped(up.address)",
            ),
        ),
        FAULTS | {"frozen"},  # what a stopped prefill's transport held lands at SIGCONT
        config=(("fencing", True), ("max_pause_s", 8.0)),  # resumed while it fences
    ),
    Mutation(
        "ended-not-awaited",
        "3 (ends not final): FAILED is said at the AbortAck, not once the Ended notification "
        "behind the released writes landed (issue 21: NIXL over UCX TCP)",
        (Edit(Incoming, "on_message", "rec.barriers.add(up.address)", "pass"),),
        config=(("ends_final", False),),
    ),
    Mutation(
        "unoffered-unbounded",
        "9: requests for ids nobody offered are held without a bound",
        (
            Edit(
                Ledger,
                "hold",
                "rec is None and self.waiting >= self.max_unoffered",
                "False",
            ),
        ),
        config=(("max_unoffered", 2), ("hostile_acts", 24)),  # a bound floods reach
    ),
    Mutation(
        "connect-every-hello",
        "11: the driver connects for every Hello, before it is checked",
        (
            Edit(
                Pairs,
                "hello",
                "down = self.downs[ident] = Down(ident, msg, now)",
                "down = self.downs[ident] = Down(ident, msg, now)\n"
                "self.out.add(act.Connect(ident, msg.endpoint, None))",
            ),
        ),
    ),
    Mutation(
        "roster-beyond-the-group",
        "13: a Join for a place outside the group (TP rank >= TP size) is held",
        (
            Edit(
                Roster,
                "join",
                "elif key == me or msg.tp_rank >= msg.tp_size or msg.pp_rank >= msg.pp_size:",
                "elif key == me:",
            ),
        ),
    ),
    Mutation(
        "roster-place-taken",
        "13: another identity takes a live member's place in the roster",
        (
            Edit(
                Roster,
                "join",
                "elif old is not None and old[1] != ident and now - old[2] <= s.dead_after_s:",
                "elif False:",
            ),
        ),
    ),
    Mutation(
        "completion-counted-twice",
        "classic: one completion counts as two",
        (Edit(Incoming, "completed", "src.seen += 1", "src.seen += 2"),),
    ),
    Mutation(
        "no-request-deadline",
        "classic: requests wait for their peers without a deadline",
        (
            Edit(Incoming, "tick", "if rec.error is None and now > rec.deadline:", "if False:"),
            Edit(Outgoing, "tick", "elif now > rec.deadline:", "elif False:"),
        ),
    ),
    Mutation(
        "no-drain-bound",
        "7: a failing request waits for a silent source's AbortAck forever",
        (
            Edit(
                Incoming,
                "tick",
                "elif rec.error is not None and now > rec.drain_until:",
                "elif False:",
            ),
        ),
    ),
    Mutation(
        "staging-released-while-failing",
        "classic: a failing request's staging goes back before its sources stopped writing",
        (
            Edit(
                Incoming,
                "fail",
                "self.out.failing(rec.handle, rec.error)",
                "self.out.failing(rec.handle, rec.error)\nself._release_slices(rec)",
            ),
        ),
        config=(("requests", 10),),  # more requests than staging: they queue for slices
    ),
    Mutation(
        "refused-pair-fails-any-place",
        "found by the simulator: a refused pair's Request fails a place another claimed",
        (
            Edit(
                Outgoing,
                "request",
                "mine = rec is None or (down.place.pp_rank, down.place.tp_rank) not in rec.dsts",
                "mine = True",
            ),
        ),
    ),
    Mutation(
        "close-says-failed-at-once",
        "found by the simulator: close() says FAILED before the sources stopped writing",
        (
            Edit(
                Protocol,
                "close",
                'self.incoming.fail(rec, "closed", why, None, now)',
                'self.incoming.fail(rec, "closed", why, None, now)\n'
                "rec.acks.clear()\nself.incoming.settle(rec)",
            ),
        ),
        config=(("close_p", 0.5), ("requests", 10)),  # Sessions closed often, writes in flight
    ),
    Mutation(
        "skip-ignored",
        "a classic: a source ignores the prefix the decode rank holds (expect(skip=))",
        (Edit(Dst, "take", "left = self._skipping(pool, ratio)", "left = 0"),),
        faults=frozenset(),  # its requests fail at plan rather than land shifted: invariant 8
        config=(("skip", 0.5),),
    ),
    Mutation(
        "layers-never-counted",
        "a classic: a layer-wise chunk's later layers are not counted, so it never completes",
        (Edit(Span, "more", "self.left = self.left - layers", "pass"),),
        faults=frozenset(),
        config=(("layered", 1.0),),
    ),
    Mutation(
        "unpacked-for-every-layer",
        "a classic: the decode rank cuts a layer-wise round from every layer's regions",
        (Edit(Unpacker, "_inbound", "layers=layers,", "layers=None,"),),
        faults=frozenset(),
        config=(("layered", 1.0), ("staging", "always")),
    ),
    Mutation(
        "pipeline-places-ignored",
        "a classic: a source counts its decode ranks by TP alone, so a pipelined decode's "
        "later stages are not waited for",
        (Edit(Outgoing, "_check", "rec.dst_size[0] * rec.dst_size[1]", "rec.dst_size[0]"),),
        faults=frozenset(),  # DONE while it still writes the other stage
        config=(("decode_pp", 2),),
    ),
    Mutation(
        "connecting-pair-silent",
        "row 26: the prefill times a pair its driver still connects to by dead_after_s, though "
        "the decode rank pings only once Welcomed",
        (
            Edit(
                Pairs,
                "_due",
                "return d.hello_at + s.handshake_timeout_s if d.connecting else",
                "return",
            ),
        ),
        faults=frozenset(),  # a slow connect alone fails a request (invariant 8)
        config=(("heartbeat_s", 0.5), ("dead_after_s", 1.5)),
    ),
    Mutation(
        "refused-hello-kept",
        "row 10: a refused pair keeps what its Hello brought (its plan of the peer's manifest)",
        (Edit(Pairs, "_refuse", "down.plan = down.staged = None", "pass"),),
    ),
    Mutation(
        "pack-not-waited",
        "a classic: a failing request does not wait for its pack in flight, which still reads "
        "the source after FAILED",
        (Edit(Outbound, "settle", "self.packing[3].result()", "pass"),),
        config=(("packer", True), ("staging", "always"), ("requests", 10)),
    ),
)

OUTSIDE = {
    "9 (the slot bound): memory held for unoffered slots": "bytes per message are not "
    "modelled (tables are: invariant 6); test_session_bounds.py",
    "11 (the pair cap)": "a flood of 16 stays under MAX_PAIRS; test_protocol_core.py::"
    "test_hellos_beyond_the_pair_cap_are_refused_and_keep_nothing",
    "12: a Session never reclaimed": "no garbage collector; test_session_stale.py",
    "14: a refused Curve key": "no sockets; test_session_failures.py",
    "15: a reconnecting decode rank refused": "a refusal is a failure, not a violation; "
    "test_protocol_core.py::test_a_decode_rank_reconnecting_after_it_lost_the_pair_is_welcomed_"
    "again",
}
"""Defects the simulator does not model, and where each is tested instead."""


@dataclass(frozen=True)
class Hunt:
    mutation: Mutation
    schedules: int  # run until the first violation (or the budget)
    violation: Violation | None


def hunt(mutation: Mutation, budget: int, config: Config | None = None) -> Hunt:
    """Run seeds 0, 1, ... under ``mutation`` until one violates an invariant."""
    base = config or Config()
    config = Config(**{**base.__dict__, **dict(mutation.config), "faults": mutation.faults})
    with mutation.applied():
        for seed in range(budget):
            result = run(seed, config)
            if result.violations:
                return Hunt(mutation, seed + 1, result.violations[0])
    return Hunt(mutation, budget, None)
