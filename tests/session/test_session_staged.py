"""Staged requests through Sessions (in one process, loopback): routes, rounds, staging returned.

The cross-process, every-driver runs are in test_session_e2e.py (its "staged"
clusters); here the Session's own state is in reach: which routes a pair
chose, that a request many times the staging runs in rounds within it, and
that every slice comes back after a request ends in any state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import xferkit as xk
from xferkit.session import RequestError, Session, State, wire
from xferkit.testing import Reference, RegionSpec
from xferkit_loopback import Faults

HEADS, DIM, PAGE, PAGES = 8, 32, 16, 48


def _specs() -> list[RegionSpec]:  # NHD pages of a GQA layer set: strided under hetero TP
    return [
        RegionSpec(pool="kv", name=n, layer=layer, shape=(PAGE, HEADS, DIM), tp_axis=1)
        for layer in range(4)
        for n in "kv"
    ]


class Ranks:
    def __init__(
        self,
        src_tp: int,
        dst_tp: int,
        faults: Faults | None = None,
        decode: dict[str, object] | None = None,
        **session: object,
    ) -> None:
        """``decode``: the decode Sessions' options where they differ from the prefill's."""
        slots = {"kv": PAGES}
        self.ref = Reference(
            _specs(), src_tp=src_tp, dst_tp=dst_tp, src_slots=slots, dst_slots=slots
        )
        self.pre = [self._session(r.manifest, session, faults) for r in self.ref.srcs]
        self.dec = [self._session(r.manifest, decode or session) for r in self.ref.dsts]
        self.sources = [p.address for p in self.pre]

    @staticmethod
    def _session(
        m: xk.Manifest, options: dict[str, object], faults: Faults | None = None
    ) -> Session:
        backend = xk.open_backend("loopback", faults=faults)
        return Session(backend, m, **options)  # type: ignore[arg-type]

    def run(self, rid: str, src: list[int], dst: list[int], chunks: int = 1) -> list[State]:
        recvs = [d.expect(rid, self.sources, {"kv": dst}) for d in self.dec]
        sends = [p.offer(rid) for p in self.pre]
        parts = np.array_split(np.asarray(src), chunks)
        for i, part in enumerate(parts):
            for s in sends:
                s.write({"kv": part}, last=i == len(parts) - 1)
        self.recvs, self.sends = recvs, sends
        return [h.wait(20) for h in recvs + sends]

    def paths(self) -> set[str]:
        """The routes the prefill ranks' pairs chose."""
        return {
            route.path
            for p in self.pre
            for down in p._protocol.pairs.downs.values()
            if down.staged is not None
            for route in down.staged.routes.values()
        }

    def staging_back(self) -> bool:
        """Every Session's staging is one free gap again: every piece came back."""
        arenas = [s._protocol.s.arena for s in self.pre + self.dec]
        return all(a.free == a.size for a in arenas)

    def close(self) -> None:
        for s in self.pre + self.dec:
            s.close()


@pytest.fixture(params=[(4, 8), (8, 4)], ids=["tp4to8", "tp8to4"])
def ranks(request: pytest.FixtureRequest) -> Iterator[Ranks]:
    # slices of 8 KiB: a half holds two heads' worth of one page (4 KiB), so a request of
    # 12 pages runs in many rounds
    r = Ranks(*request.param, staging="auto", staging_bytes=1 << 15, staging_slice_bytes=1 << 13)
    yield r
    r.close()


def test_the_cost_model_stages_nhd_heterogeneous_tp_and_bytes_are_exact(ranks: Ranks) -> None:
    src, dst = list(range(12)), [47 - 3 * i for i in range(12)]
    assert set(ranks.run("r", src, dst, chunks=3)) == {State.DONE}
    for i in range(len(ranks.dec)):
        ranks.ref.check(i, {"kv": (src, dst)})
    routes = ranks.paths()
    assert routes and routes <= {"pack", "unpack", "both"}, routes
    assert ranks.staging_back()  # every piece came back


def test_each_ranks_timeline_places_its_stages_inside_the_request(ranks: Ranks) -> None:
    """Where a staged request's time went, per rank: prefill ranks plan, pack, post and wire,
    decode ranks land and unpack; every span lies inside the handle's own start -> DONE, and
    the serial work (plan, pack, unpack: one thread each) inside its span."""
    assert set(ranks.run("r", list(range(12)), list(range(12, 24)), chunks=3)) == {State.DONE}
    paths = ranks.paths()
    packs, unpacks = bool(paths & {"pack", "both"}), bool(paths & {"unpack", "both"})
    for handles, stages in (
        (ranks.sends, {"plan", "post", "wire"} | ({"pack"} if packs else set())),
        (ranks.recvs, {"landed"} | ({"unpack"} if unpacks else set())),
    ):
        for h in handles:
            assert set(h.timeline) == stages, h.timeline
            if h in ranks.sends:  # what it moved, each way, and with whom
                readers = {d.address for d in ranks.dec if ranks.sources[ranks.sends.index(h)]
                           in d._protocol.pairs.ups}  # fmt: skip
                assert set(h.routes.peers) == readers and readers
                assert h.routes.staged_descriptors > 0
            else:
                assert set(h.routes.peers) <= set(ranks.sources) and h.routes.peers
            start, done = min(h.times.values()), h.times[State.DONE]
            for name, span in h.timeline.items():
                assert start <= span.start <= span.end <= done, (name, span, start, done)
                assert span.busy >= 0
                if name in ("plan", "pack", "unpack"):
                    assert 0 < span.busy <= span.seconds + 1e-9, (name, span)


def test_more_requests_than_slices_all_complete_and_return_their_staging(ranks: Ranks) -> None:
    for n in range(10):  # each takes a slice per chunk on each side: more than the 4 there are
        assert set(ranks.run(f"r{n}", [n, n + 1], [2 * n, 2 * n + 1])) == {State.DONE}
    assert ranks.staging_back()


def test_an_aborted_staged_request_returns_its_staging_and_writes_nothing_after(
    ranks: Ranks,
) -> None:
    recvs = [d.expect("gone", ranks.sources, {"kv": list(range(20, 44))}) for d in ranks.dec]
    recvs[0].abort(10)
    assert recvs[0].poll() is State.FAILED
    sends = [p.offer("gone") for p in ranks.pre]
    for s in sends:
        s.write({"kv": list(range(24))}, last=True)
    for h in recvs + sends:
        with pytest.raises(RequestError) as info:
            h.wait(10)
        assert info.value.stage == "abort" and str(info.value) == str(recvs[0].error)
    for d in ranks.ref.dsts:  # the engine reuses the slots at once
        for a in d.arrays.values():
            a[20:44] = 0x5A
    assert set(ranks.run("after", [0], [0])) == {State.DONE}  # the pair still works
    for d in ranks.ref.dsts:
        for a in d.arrays.values():
            assert (a[20:44] == 0x5A).all()  # no late round or unpack landed
    assert ranks.staging_back()


def test_chunks_to_many_decode_ranks_all_stage_at_the_default_sizes() -> None:
    """An engine's shape: a prefill rank writes 3 chunks to each of its 2 decode ranks at once.
    Fixed 16 MiB slices (4 of them in the default 64 MiB) sent 2 of those 6 small chunks the
    direct way, one descriptor per token row; pieces sized to their chunks stage all 6."""
    r = Ranks(4, 8, staging="auto")
    try:
        recvs = [d.expect("r", r.sources, {"kv": list(range(12, 24))}) for d in r.dec]
        sends = [p.offer("r") for p in r.pre]
        for i, part in enumerate(np.array_split(np.arange(12), 3)):
            for h in sends:
                h.write({"kv": part}, last=i == 2)
        assert {h.wait(20) for h in recvs + sends} == {State.DONE}
        assert [(h.routes.staged, h.routes.direct) for h in sends] == [(6, 0)] * 4
        # every byte went through staging: the 12 slots of each decode rank's regions
        slot = sum(region.slot_nbytes for region in r.ref.dsts[0].manifest.regions)
        assert sum(h.routes.staged_bytes for h in sends) == 12 * slot * len(r.dec)
        assert sum(h.routes.direct_bytes for h in sends) == 0
        for i in range(len(r.dec)):
            r.ref.check(i, {"kv": (list(range(12)), list(range(12, 24)))})
        assert r.staging_back()
    finally:
        r.close()


# One unit (a region's page, 4 of the 8 heads) is 4 KiB: a 16 KiB slice halves into rounds of
# 2 units, and a chunk of many units needs the whole of the prefill rank's staging.
FULL = {"staging": "always", "staging_bytes": 1 << 14, "staging_slice_bytes": 1 << 14}


def _hold_staging(r: Ranks, rid: str) -> list[xk.Send]:
    """Request ``rid``, whose first round stalls in the driver: its chunk keeps the staging
    (returns once that round is posted)."""
    for d in r.dec:
        d.expect(rid, r.sources, {"kv": list(range(24))})
    sends = [p.offer(rid) for p in r.pre]
    for h in sends:
        h.write({"kv": list(range(24))}, last=True)
    limit = time.monotonic() + 10
    while sends[0].poll() is not State.TRANSFERRING and time.monotonic() < limit:
        time.sleep(0.01)
    return sends


def test_a_chunk_finding_staging_full_waits_for_it_and_then_stages() -> None:
    r = Ranks(1, 2, faults=Faults(stall_post_at=1), **FULL)  # type: ignore[arg-type]
    try:
        stalled = _hold_staging(r, "a")
        before = [a[24:48].copy() for d in r.ref.dsts for a in d.arrays.values()]
        recvs = [d.expect("b", r.sources, {"kv": list(range(24, 48))}) for d in r.dec]
        (send,) = [p.offer("b") for p in r.pre]
        send.write({"kv": list(range(24, 48))}, last=True)
        with pytest.raises(xk.XferError, match="still"):
            send.wait(1.0)  # waiting for staging, not writing the slower way
        after = [a[24:48] for d in r.ref.dsts for a in d.arrays.values()]
        assert all((x == y).all() for x, y in zip(before, after, strict=True))
        stalled[0].abort(10)  # gives the staging back
        assert {h.wait(20) for h in [*recvs, send]} == {State.DONE}
        routes = send.routes
        assert (routes.staged, routes.direct) == (2, 0) and routes.staging_wait_s >= 1.0
        for i in range(len(r.dec)):
            r.ref.check(i, {"kv": (list(range(24, 48)), list(range(24, 48)))})
        assert r.staging_back()
    finally:
        r.close()


def test_a_chunk_waiting_for_staging_fails_at_its_deadline_having_written_nothing() -> None:
    r = Ranks(1, 2, faults=Faults(stall_post_at=1), request_timeout_s=2.0, **FULL)  # type: ignore[arg-type]
    try:
        # b's deadline comes before a's, so a still holds the staging when b's passes
        before = [a[24:48].copy() for d in r.ref.dsts for a in d.arrays.values()]
        recvs = [d.expect("b", r.sources, {"kv": list(range(24, 48))}) for d in r.dec]
        (send,) = [p.offer("b") for p in r.pre]
        time.sleep(0.5)
        held = _hold_staging(r, "a")
        send.write({"kv": list(range(24, 48))}, last=True)
        for h in [*recvs, send]:
            with pytest.raises(RequestError) as info:
                h.wait(20)
            assert info.value.stage == "timeout"
        assert send.routes.direct == 0 and send.routes.staging_wait_s > 0
        after = [a[24:48] for d in r.ref.dsts for a in d.arrays.values()]
        assert all((x == y).all() for x, y in zip(before, after, strict=True))
        with pytest.raises(RequestError):
            held[0].wait(20)  # a times out too, later
        assert r.staging_back()
    finally:
        r.close()


def _chunked(r: Ranks, rid: str, chunks: int) -> xk.Send:
    """One request of ``chunks`` chunks of 2 pages each, written at once; the first Send."""
    pages = list(range(2 * chunks))
    recvs = [d.expect(rid, r.sources, {"kv": pages}) for d in r.dec]
    sends = [p.offer(rid) for p in r.pre]
    for i in range(chunks):
        for send in sends:
            send.write({"kv": pages[2 * i : 2 * i + 2]}, last=i == chunks - 1)
    assert {h.wait(20) for h in [*recvs, *sends]} == {State.DONE}
    for i in range(len(r.dec)):
        r.ref.check(i, {"kv": (pages, pages)})
    return sends[0]


def test_chunks_queued_for_the_staging_one_after_another_all_complete() -> None:
    """Each chunk needs the whole of the prefill rank's staging, so each waits for the one
    before to give it back; that hand-over pumps the same decode rank's chunks again from
    inside a pump (it crashed the control thread once a finished chunk was let go twice)."""
    r = Ranks(1, 2, **FULL)  # type: ignore[arg-type]
    try:
        send = _chunked(r, "r", 6)
        assert (send.routes.staged, send.routes.direct) == (12, 0)
        # planning ends with the last round planned, before that round's write completed:
        # not at the last completion (every event added an empty "plan" span per chunk)
        assert send.timeline["plan"].end < send.timeline["wire"].end
        assert r.staging_back()
    finally:
        r.close()


@pytest.mark.parametrize("staging", ["always", "never"])
def test_chunks_written_before_the_decode_ranks_ask_are_cut_as_one(staging: str) -> None:
    """Under load a decode rank asks once its own staging is free, and the engine has
    written every chunk by then: they go as one chunk (staged: cut, packed, written and
    unpacked once; direct: expanded and written once). Before, each was its own write on
    both ranks (6 to each decode rank, not 1)."""
    r = Ranks(1, 2, staging=staging)
    try:
        pages = list(range(12))
        (send,) = [p.offer("r") for p in r.pre]
        for i in range(6):
            send.write({"kv": pages[2 * i : 2 * i + 2]}, last=i == 5)
        recvs = [d.expect("r", r.sources, {"kv": pages}) for d in r.dec]
        assert {h.wait(20) for h in [*recvs, send]} == {State.DONE}
        routes = send.routes  # 6 chunks to each of the 2 decode ranks
        assert (routes.staged, routes.direct) == ((12, 0) if staging == "always" else (0, 12))
        assert routes.writes == len(r.dec)
        slot = sum(region.slot_nbytes for region in r.ref.dsts[0].manifest.regions)
        assert routes.staged_bytes + routes.direct_bytes == 12 * slot * len(r.dec)
        for i in range(len(r.dec)):
            r.ref.check(i, {"kv": (pages, pages)})
        assert r.staging_back()
    finally:
        r.close()


def test_chunks_waiting_for_the_prefill_ranks_staging_join_the_one_before() -> None:
    """The decode ranks asked first; the chunks then find the prefill rank's staging held
    by another request, wait, and each joins the one waiting before it. A decode rank's
    unit here is 32 KiB a page, a round at most 64 KiB: the 4 one-page chunks take 2
    rounds to each decode rank, where they took 4. The bytes land where each chunk said."""
    slice_bytes = 1 << 17
    r = Ranks(
        1,
        2,
        faults=Faults(stall_post_at=1),
        decode={"staging": "always"},
        staging="always",
        staging_bytes=slice_bytes,
        staging_slice_bytes=slice_bytes,
    )
    try:
        held = _hold_staging(r, "a")  # a round of it stalls holding all of this staging
        pages = list(range(24, 28))
        recvs = [d.expect("b", r.sources, {"kv": pages}) for d in r.dec]
        (send,) = [p.offer("b") for p in r.pre]
        limit = time.monotonic() + 10
        while send.poll() is not State.WAITING and time.monotonic() < limit:
            time.sleep(0.01)  # both decode ranks' Requests arrived: b's chunks are planned
        for i, page in enumerate(pages):
            send.write({"kv": [page]}, last=i == len(pages) - 1)
        with pytest.raises(xk.XferError, match="still"):
            send.wait(0.5)  # waiting for the staging
        held[0].abort(10)  # gives it back
        assert {h.wait(20) for h in [*recvs, send]} == {State.DONE}
        assert (send.routes.staged, send.routes.direct) == (8, 0)
        assert send.routes.writes == 2 * len(r.dec)
        assert send.routes.staging_wait_s >= 0.5
        for i in range(len(r.dec)):
            r.ref.check(i, {"kv": (pages, pages)})
        assert r.staging_back()
    finally:
        r.close()


@pytest.mark.parametrize(
    ("tp", "staging", "path"),
    [((1, 2), FULL, "pack"), ((2, 1), {"staging": "always"}, "unpack")],
    ids=["packs-queued-for-staging", "unpacks-queued-for-the-decode-halves"],
)
def test_a_requests_planning_work_grows_linearly_with_its_chunks(
    monkeypatch: pytest.MonkeyPatch, tp: tuple[int, int], staging: dict, path: str
) -> None:
    """Every event of a request pumps its staged chunks. The finished ones, and those queued
    behind a taken half of the decode rank's staging, were each asked for a round every
    time: quadratic in the chunks of a long chunked prefill or a layer-wise request
    (measured before: 541 -> 6,973 calls and 76 -> 1,280 for 4 -> 16 chunks)."""
    from xferkit.session import rounds

    calls = [0]
    ready = rounds.Outbound.ready

    def counted(self: rounds.Outbound) -> object:
        calls[0] += 1
        return ready(self)

    monkeypatch.setattr(rounds.Outbound, "ready", counted)
    r = Ranks(*tp, **staging)
    try:
        work = []
        for n, chunks in enumerate((4, 16)):
            calls[0] = 0
            send = _chunked(r, f"r{n}", chunks)
            work.append(calls[0])
            assert send.routes.staged == chunks * len(r.dec) and not send.routes.direct
        assert r.paths() == {path}
        assert work[1] <= 4 * work[0] * 1.5, work  # 4x the chunks: about 4x the calls
    finally:
        r.close()


def test_staging_never_keeps_every_pair_direct() -> None:
    r = Ranks(4, 8, staging="never")
    try:
        assert set(r.run("r", [1, 2], [3, 4])) == {State.DONE}
        assert all(d.staged is None for p in r.pre for d in p._protocol.pairs.downs.values())
        assert all(s._protocol.s.arena.size == 0 for s in r.pre + r.dec)
        for i in range(len(r.dec)):
            r.ref.check(i, {"kv": ([1, 2], [3, 4])})
    finally:
        r.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"staging": "sometimes"}, "staging must be"),
        ({"staging_bytes": -1}, "staging_bytes"),
        ({"staging_slice_bytes": 2.5}, "staging_slice_bytes"),
        ({"staging_bytes": 100, "staging_slice_bytes": 200}, "within 1..staging_bytes"),
    ],
)
def test_bad_staging_options_name_themselves(kwargs: dict, match: str) -> None:
    ref = Reference(_specs(), src_tp=1, dst_tp=1, src_slots={"kv": 2}, dst_slots={"kv": 2})
    with pytest.raises(xk.XferError, match=match):
        Session(xk.open_backend("loopback"), ref.srcs[0].manifest, **kwargs)


def _forge(ranks: Ranks, rid: str, rounds: list[wire.Round]) -> RequestError:
    """Prefill rank 0's backend sends decode rank 0 completion tags naming staged rounds that
    were never written (a buggy or hostile peer); returns decode rank 0's root cause."""
    recv = ranks.dec[0].expect(rid, ranks.sources, {"kv": [0, 1]})
    deadline = time.monotonic() + 10
    while recv.poll() is not State.WAITING and time.monotonic() < deadline:
        time.sleep(0.01)
    gen = ranks.dec[0]._protocol.incoming.recvs[rid].gen
    peer = next(d.peer for d in ranks.pre[0]._protocol.pairs.downs.values() if d.place.tp_rank == 0)
    assert peer is not None
    for r in rounds:
        tag = wire.Tag(rid, gen, 0, 0, 0, r)
        ranks.pre[0].backend.write(peer, xk.Descriptors.empty(), wire.encode(tag)).wait(5)
    with pytest.raises(RequestError) as info:
        recv.wait(10)
    return info.value


def test_forged_staged_rounds_fail_the_request_and_write_nowhere_else(ranks: Ranks) -> None:
    arrays = ranks.ref.dsts[0].arrays.values()
    for a in arrays:
        a[0:4] = 0x5A
    outside = _forge(ranks, "outside", [wire.Round(chunk=0, index=0, at={"kv": (1, 5, 5)})])
    assert outside.stage == "transfer" and "prefill rank 0" in str(outside)
    assert "nothing of it was unpacked" in str(outside)
    assert all((a[0:4] == 0x5A).all() for a in arrays)  # refused before any copy
    many = [wire.Round(chunk=c, index=0, at={"kv": (0, 1, 1)}) for c in range(1000)]
    flood = _forge(ranks, "flood", many)  # bounded: a chunk never names slots another named
    assert flood.stage == "transfer" and "slots [0, +1) of pool 'kv'" in str(flood)
    # A peer may fill the slots a request offered it (with garbage, if it lies); never others.
    assert all((a[2:4] == 0x5A).all() for a in arrays)
