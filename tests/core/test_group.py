"""xferkit.group: a request across a TP group, reduced with MIN as an engine's collective would."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xferkit import Backend, XferError, group
from xferkit.session import Session, State
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver

SLOTS = {"kv": 8, "state": 4}
STATES = [State.HANDSHAKING, State.WAITING, State.TRANSFERRING, State.DONE, State.FAILED]


@dataclass
class Fake:
    """A handle's reading surface: its state, whether it is known to fail, its times."""

    state: State
    draining: bool = False  # failing while not FAILED yet
    failed_at: float = 0.0  # monotonic, when FAILED
    times: dict = field(default_factory=dict)

    def poll(self) -> State:
        return self.state

    @property
    def failing(self) -> object:
        return "why" if self.state is State.FAILED or self.draining else None


def _rank(state: State, draining: bool, when: float) -> Fake:
    h = Fake(state, draining and state is not State.FAILED and state is not State.DONE)
    if state is State.FAILED:
        h.times[State.FAILED] = when
    return h


ranks = st.lists(
    st.tuples(st.sampled_from(STATES), st.booleans(), st.floats(0, 1e4)), min_size=1, max_size=8
)


@given(ranks)
def test_the_reduced_verdict_is_the_groups_as_a_model_states_it(spec: list) -> None:
    handles = [_rank(*r) for r in spec]
    rows = [group.summarize([h]) for h in handles]
    reduced = group.reduce(rows)
    (g,) = group.read(reduced)
    terminal = [h.state in (State.DONE, State.FAILED) for h in handles]
    failing = [h.failing is not None for h in handles]
    assert g.safe_to_free == all(terminal)  # never while some rank may still write
    assert g.failed == any(failing)
    if all(terminal):
        assert g.state is (State.FAILED if any(failing) else State.DONE)
    else:
        order = [State.HANDSHAKING, State.WAITING, State.TRANSFERRING]
        assert g.state is min((h.state for h in handles if h.state in order), key=order.index)
    firsts = [bool(group.first_failure(r, reduced)[0]) for r in rows]
    assert any(firsts) == any(failing)
    if any(f.state is State.FAILED for f in handles) and not any(
        f.draining for f in handles
    ):  # FAILED times only: the earliest is the root
        earliest = min(f.times[State.FAILED] for f in handles if f.state is State.FAILED)
        for f, first in zip(handles, firsts, strict=True):
            if first:
                assert f.times[State.FAILED] == pytest.approx(earliest, abs=1e-5)


def test_a_real_pair_of_handles_reads_done_and_safe() -> None:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(Backend(MockDriver()), ref.srcs[0].manifest)
    dec = Session(Backend(MockDriver()), ref.dsts[0].manifest)
    try:
        recv = dec.expect("r", [pre.address], {"kv": [2]})
        waiting = group.summarize([recv])
        assert not group.read(waiting)[0].safe_to_free
        pre.offer("r").write({"kv": [1]}, last=True)
        assert recv.wait(10) is State.DONE
        gone = dec.expect("gone", [pre.address], {"kv": [3]})
        gone.abort(10)
        rows = group.summarize([recv, gone])
        assert rows.shape == (2, 4) and rows.dtype == np.int64
        done, failed = group.read(rows)
        assert (done.state, done.safe_to_free, done.failed) == (State.DONE, True, False)
        assert (failed.state, failed.safe_to_free, failed.failed) == (State.FAILED, True, True)
        assert list(group.first_failure(rows, rows)) == [False, True]
    finally:
        pre.close()
        dec.close()


def test_anything_but_handles_is_refused_naming_it() -> None:
    with pytest.raises(XferError, match="takes request handles"):
        group.summarize([3])


@pytest.mark.parametrize(
    "call",
    [
        lambda: group.summarize(3),  # type: ignore[arg-type]
        lambda: group.read("abc"),  # type: ignore[arg-type]
        lambda: group.read([[1, 2, 3]]),  # type: ignore[arg-type]
        lambda: group.read([[0, 1, 99, 0]]),  # type: ignore[arg-type]  # no such progress
        lambda: group.reduce([]),
        lambda: group.reduce([np.zeros((1, 4)), np.zeros((2, 4))]),
        lambda: group.first_failure([1], [[1, 2, 3, 4]]),  # type: ignore[arg-type]
        lambda: group.first_failure(np.zeros((2, 4)), np.zeros((1, 4))),
    ],
)
def test_wrong_shapes_and_types_are_argument_errors(call: object) -> None:
    """Before: raw TypeError and ValueError from numpy."""
    with pytest.raises(XferError):
        call()  # type: ignore[operator]
