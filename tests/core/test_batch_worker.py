"""``BatchWorker``: batches run in the order posted; with ``together``, those queued behind
the running one go as one run (bounded), each ending with the run's outcome."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xferkit.driver import ArgumentError, BatchWorker, Descriptors, QueuedBatch, Status

WAIT_S = 30.0


def _batch(entries: int, tag: int) -> QueuedBatch:
    ones = np.full(entries, tag, np.uint64)
    return QueuedBatch(Descriptors(ones, ones, ones), f"m{tag}".encode())


class _Engine:
    """Holds the first call until ``go`` is set, so that the next batches queue behind it;
    records what each call received."""

    def __init__(self, error: str | None = None) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list[bytes | None]] = []
        self.error = error

    def one(self, batch: QueuedBatch) -> str | None:
        return self.many([batch])

    def many(self, run: list[QueuedBatch]) -> str | None:
        self.entered.set()
        self.go.wait(WAIT_S)
        self.calls.append([b.notify for b in run])
        return self.error


def _post_behind(worker: BatchWorker[QueuedBatch], engine: _Engine, batches: list[QueuedBatch]):
    first = _batch(1, 99)
    worker.post(first)
    assert engine.entered.wait(WAIT_S)  # the worker holds ``first``: the rest queue behind
    for b in batches:
        worker.post(b)
    engine.go.set()
    for b in [first, *batches]:
        b.block(WAIT_S)
    return first


def test_batches_queued_behind_run_together_in_order_within_the_bounds() -> None:
    engine = _Engine()
    worker = BatchWorker(engine.one, "t", together=engine.many, max_run=4, max_entries=10)
    batches = [_batch(3, i) for i in range(9)]
    _post_behind(worker, engine, batches)
    # The first ran alone (nothing was queued when it started); the rest in runs of at most
    # 4 batches and 10 entries (3 + 3 + 3).
    assert engine.calls[0] == [b"m99"]
    runs = engine.calls[1:]
    assert [m for run in runs for m in run] == [f"m{i}".encode() for i in range(9)]
    assert [len(run) for run in runs] == [3, 3, 3]
    assert all(b.poll() is Status.DONE for b in batches)
    worker.stop()
    assert worker.join(WAIT_S)


def test_a_failed_run_fails_each_of_its_batches_saying_they_ran_together() -> None:
    engine = _Engine(error="peer refused")
    worker = BatchWorker(engine.one, "t", together=engine.many)
    batches = [_batch(1, i) for i in range(3)]
    first = _post_behind(worker, engine, batches)
    assert first.error == "peer refused"  # alone: the engine's text as it was
    for b in batches:
        assert b.poll() is Status.FAILED
        assert b.error == "peer refused (moved in one engine call with 2 other batch(es))"
    worker.stop()
    assert worker.join(WAIT_S)


def test_a_batch_released_while_queued_is_left_out_of_the_run() -> None:
    engine = _Engine()
    worker = BatchWorker(engine.one, "t", together=engine.many)
    batches = [_batch(1, i) for i in range(3)]
    batches[1].release()
    _post_behind(worker, engine, batches)
    assert engine.calls[1:] == [[b"m0", b"m2"]]
    assert batches[1].error == "aborted before it ran"
    worker.stop()
    assert worker.join(WAIT_S)


def test_a_stop_queued_among_batches_ends_the_thread_after_those_before_it() -> None:
    engine = _Engine()
    worker = BatchWorker(engine.one, "t", together=engine.many)
    first = _batch(1, 99)
    worker.post(first)
    assert engine.entered.wait(WAIT_S)
    before = [_batch(1, i) for i in range(2)]
    for b in before:
        worker.post(b)
    worker.stop()
    after = _batch(1, 7)
    worker.post(after)
    engine.go.set()
    assert worker.join(WAIT_S)
    assert all(b.poll() is Status.DONE for b in [first, *before])
    assert after.poll() is Status.PENDING  # never taken: the driver stopped the worker first


def test_an_exception_in_a_run_fails_every_batch_and_the_worker_goes_on() -> None:
    engine = _Engine()

    def boom(run: list[QueuedBatch]) -> str | None:
        engine.many(run)
        raise RuntimeError("engine crashed")

    worker = BatchWorker(engine.one, "t", together=boom)
    batches = [_batch(1, i) for i in range(2)]
    _post_behind(worker, engine, batches)
    assert all(b.error == "driver worker error: RuntimeError: engine crashed" for b in batches)
    later = _batch(1, 5)
    worker.post(later)
    later.block(WAIT_S)
    assert later.poll() is Status.DONE
    worker.stop()
    assert worker.join(WAIT_S)


def test_without_together_each_batch_is_its_own_call() -> None:
    engine = _Engine()
    worker = BatchWorker(engine.one, "t")
    batches = [_batch(1, i) for i in range(3)]
    _post_behind(worker, engine, batches)
    assert engine.calls == [[b"m99"], [b"m0"], [b"m1"], [b"m2"]]
    worker.stop()
    assert worker.join(WAIT_S)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=30),
    st.integers(1, 6),
    st.integers(1, 20),
)
def test_any_queue_runs_in_order_once_each_within_the_bounds(
    batches: list[tuple[int, bool]], max_run: int, max_entries: int
) -> None:
    """Against the model: the batches not released run once each, in the order posted, in
    runs of at most ``max_run`` batches and ``max_entries`` entries (a batch larger than
    that alone); released ones end "aborted before it ran" without running."""
    engine = _Engine()
    worker = BatchWorker(
        engine.one, "t", together=engine.many, max_run=max_run, max_entries=max_entries
    )
    posted = [_batch(n, i) for i, (n, _) in enumerate(batches)]
    first = _batch(1, 99)
    worker.post(first)
    assert engine.entered.wait(WAIT_S)
    for b, (_, released) in zip(posted, batches, strict=True):
        if released:
            b.release()
        worker.post(b)
    engine.go.set()
    for b in posted:
        b.block(WAIT_S)
    worker.stop()
    assert worker.join(WAIT_S)
    kept = [f"m{i}".encode() for i, (_, released) in enumerate(batches) if not released]
    assert [m for run in engine.calls[1:] for m in run] == kept
    size = {f"m{i}".encode(): n for i, (n, _) in enumerate(batches)}
    for run in engine.calls[1:]:
        assert len(run) <= max_run
        assert len(run) == 1 or sum(size[m] for m in run if m is not None) <= max_entries
    for b, (_, released) in zip(posted, batches, strict=True):
        assert b.poll() is (Status.FAILED if released else Status.DONE)
        assert (b.error == "aborted before it ran") is released


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"max_run": "3"}, "max_run"),
        ({"max_run": 0}, "max_run"),
        ({"max_entries": True}, "max_entries"),
        ({"max_entries": 2.5}, "max_entries"),
        ({"together": "fast"}, "together"),
        ({"execute": None}, "execute"),
        ({"nice": 20}, "nice"),
        ({"nice": -5}, "nice"),
        ({"nice": True}, "nice"),
    ],
)
def test_a_careless_driver_author_gets_an_argument_error_naming_the_bad_one(
    kwargs: dict, culprit: str
) -> None:
    """Before, a wrong bound passed the constructor and killed the worker thread at the
    first run, leaving every batch queued behind it pending."""
    engine = _Engine()
    args = {"execute": engine.one, "name": "t", "together": engine.many, **kwargs}
    with pytest.raises(ArgumentError, match=f"BatchWorker's {culprit} must be"):
        BatchWorker(**args)
