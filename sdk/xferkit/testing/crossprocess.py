"""The conformance kit's cross-process tests: the other rank is a peer process.

The peer is ``python -m xferkit.testing.peer`` (see ``peer``): it opens the
same backend with the same options and answers JSON lines, so the bytes it
receives are checked where they land. Each test's docstring states the
obligation it checks (``python -m xferkit.testing.conformance --table``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ..backend import Backend, Peer
from ..descriptors import Descriptors
from ..driver import Status
from ..errors import CapabilityError, TransferError
from ..manifest import Manifest
from ..planner import coverage
from .kit import (
    DST_SLOTS,
    REQUEST,
    SRC_SLOTS,
    KitBase,
    await_end,
    buffers,
    gdn_hybrid_specs,
    in_batches,
    note,
    post_end,
    raw_manifest,
)
from .pairs import close_all
from .peer import Check, Drain, Fill, PeerProcess, Reply, Setup, Write, reference
from .reference import Reference, RegionSpec

SENTINEL = 0xA5
"""What a receiver's memory holds before the frozen-peer test's write: its bytes show."""


def peer_setup(
    backend: str,
    options: dict[str, Any],
    role: str,
    index: int,
    src_tp: int,
    dst_tp: int,
    specs: list[RegionSpec] | None = None,
    src_slots: dict[str, int] = SRC_SLOTS,
    dst_slots: dict[str, int] = DST_SLOTS,
) -> Setup:
    """What a peer process (``xferkit.testing.peer``) needs to be one rank of a handoff.

    ``specs`` None: the kit's GDN hybrid model.
    """
    return Setup(
        backend=backend,
        options=dict(options),
        specs=gdn_hybrid_specs() if specs is None else specs,
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots=src_slots,
        dst_slots=dst_slots,
        role=role,
        index=index,
    )


def peer_memory(pid: int, manifest: Manifest) -> np.ndarray:
    """Every byte of ``manifest``'s regions in process ``pid`` (a child of ours), read through
    ``/proc/<pid>/mem``: works while it is stopped, so a test sees what landed by then."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        parts = []
        for region in manifest.regions:
            mem.seek(region.addr)
            parts.append(np.frombuffer(mem.read(region.nbytes), dtype=np.uint8))
    return np.concatenate(parts)


class CrossProcessConformance(KitBase):
    """What a driver claiming ``cross_process`` must do with a peer in another process."""

    def _setup(self, role: str, index: int, src_tp: int, dst_tp: int) -> Setup:
        return peer_setup(self.backend, self.options, role, index, src_tp, dst_tp)

    @contextlib.contextmanager
    def _ranks_beside_a_peer(
        self, role: str, index: int, src_tp: int, dst_tp: int
    ) -> Iterator[tuple[Reply, Reference, list[Backend], PeerProcess]]:
        """A peer process set up as ``role`` rank ``index``; backends here for the other side."""
        self._cross_process()
        setup = self._setup(role, index, src_tp, dst_tp)
        ref = reference(setup)
        here = ref.srcs if role == "dst" else ref.dsts
        opened: list[Backend] = []
        try:
            for _ in here:
                opened.append(self.open())
            with PeerProcess() as peer_proc:
                ready = peer_proc.ask(setup)
                assert ready.ok, ready.error
                for backend, rank in zip(opened, here, strict=True):
                    backend.register(rank.manifest)
                yield ready, ref, opened, peer_proc
        finally:
            close_all(*opened)

    def _cross_process(self) -> None:
        """Skip (never pass) unless the driver claims cross-process; if not, it must refuse."""
        with self.open() as b:
            if b.capabilities.cross_process:
                return
            with pytest.raises(CapabilityError), PeerProcess() as p:
                r = p.ask(self._setup("dst", 0, 1, 1))
                b.register(raw_manifest(buffers([64], 0), "x"))
                b.connect(r.endpoint, Manifest.decode(r.manifest))
        pytest.skip(f"{self.backend} declares no cross-process support (refused, as it should)")

    def test_cross_process_write_into_peer(self) -> None:
        """Prefill TP 2 here writes into decode rank 1 of TP 4 in a peer process: byte-exact
        there, one notification per source. A driver without cross_process must refuse the
        peer's endpoint (CapabilityError); the cross-process tests are then skipped."""
        with self._ranks_beside_a_peer("dst", 1, 2, 4) as (ready, ref, srcs, peer_proc):
            dst_manifest = Manifest.decode(ready.manifest)
            cov = coverage([r.manifest for r in ref.srcs], dst_manifest)
            for s in cov.sources:
                peer = srcs[s].connect(ready.endpoint, dst_manifest)
                notify = b"sent" if srcs[s].capabilities.notifications else None
                srcs[s].write(peer, cov.plans[s].expand(REQUEST), notify).wait(self.wait_s)
            result = peer_proc.ask(Check(slots=REQUEST))
            assert result.ok, result.error
            if srcs[0].capabilities.notifications:
                deadline = time.monotonic() + self.wait_s
                notes: list = []
                while len(notes) < len(cov.sources) and time.monotonic() < deadline:
                    notes += peer_proc.ask(Drain(timeout=1.0)).notes
                assert [m for _, m in notes] == [b"sent"] * len(cov.sources)

    def test_cross_process_write_from_peer(self) -> None:
        """A peer process (prefill TP 1) writes into this one (decode TP 2): byte-exact here."""
        with self._ranks_beside_a_peer("src", 0, 1, 2) as (_, ref, dsts, peer_proc):
            for i, (backend, rank) in enumerate(zip(dsts, ref.dsts, strict=True)):
                w = Write(
                    endpoint=backend.endpoint(), manifest=rank.manifest.encode(), slots=REQUEST
                )
                reply = peer_proc.ask(w)
                assert reply.ok, reply.error
                ref.check(i, REQUEST)

    def test_cross_process_every_rank_in_its_own_process(self) -> None:
        """Prefill TP 2 -> decode TP 4 with every rank in its own process, as deployed:
        byte-exact on every decode rank, each notification from the right source."""
        self._cross_process()
        with contextlib.ExitStack() as stack:
            # Start all six processes first: they boot in parallel.
            srcs = [stack.enter_context(PeerProcess()) for _ in range(2)]
            dsts = [stack.enter_context(PeerProcess()) for _ in range(4)]
            src_ready = [p.ask(self._setup("src", i, 2, 4)) for i, p in enumerate(srcs)]
            dst_ready = [p.ask(self._setup("dst", j, 2, 4)) for j, p in enumerate(dsts)]
            replies = src_ready + dst_ready
            assert all(r.ok for r in replies), [r.error for r in replies]
            src_manifests = [Manifest.decode(r.manifest) for r in src_ready]
            assert all(m.dropped for m in src_manifests)  # the empty short-conv entries
            expected: dict[int, list[bytes]] = {}
            for j, ready in enumerate(dst_ready):
                sources = coverage(src_manifests, Manifest.decode(ready.manifest)).sources
                assert sources  # every decode rank is fed by at least one prefill rank
                expected[j] = sorted(f"prefill {s} -> decode {j}".encode() for s in sources)
                for s in sources:
                    write = Write(
                        endpoint=ready.endpoint,
                        manifest=ready.manifest,
                        slots=REQUEST,
                        notify=f"prefill {s} -> decode {j}".encode() if self._notes() else None,
                    )
                    reply = srcs[s].ask(write)
                    assert reply.ok, reply.error
            for j, proc in enumerate(dsts):
                result = proc.ask(Check(slots=REQUEST))
                assert result.ok, f"decode rank {j}: {result.error}"
                if not self._notes():
                    continue
                notes: list = []
                deadline = time.monotonic() + self.wait_s
                while len(notes) < len(expected[j]) and time.monotonic() < deadline:
                    notes += proc.ask(Drain(timeout=0.5)).notes
                assert sorted(m for _, m in notes) == expected[j]

    def _notes(self) -> bool:
        with self.open() as b:
            return b.capabilities.notifications

    @contextlib.contextmanager
    def _writing_to_a_peer_process(
        self, specs: list[RegionSpec] | None, slots: int, request: Any, **extra: Any
    ) -> Iterator[tuple[Backend, PeerProcess, Peer, Descriptors]]:
        """A backend here, connected to decode rank 0 (TP 1) in a peer process, and the
        request's descriptors; the test may kill or stop the peer process. ``specs`` None: the
        kit's GDN hybrid."""
        self._cross_process()
        sizes: dict[str, Any] = {"src_tp": 1, "dst_tp": 1}
        sizes["src_slots"] = sizes["dst_slots"] = {"raw": slots}
        if specs is None:
            specs, sizes["src_slots"], sizes["dst_slots"] = gdn_hybrid_specs(), SRC_SLOTS, DST_SLOTS
        setup = Setup(self.backend, dict(self.options), specs, role="dst", index=0, **sizes)
        ref = Reference(specs, **sizes)
        with self.open(**extra) as src, PeerProcess() as peer_proc:
            src.register(ref.srcs[0].manifest)
            ready = peer_proc.ask(setup)
            assert ready.ok, ready.error
            dst_manifest = Manifest.decode(ready.manifest)
            peer = src.connect(ready.endpoint, dst_manifest)
            plan = coverage([ref.srcs[0].manifest], dst_manifest).plans[0]
            yield src, peer_proc, peer, plan.expand(request)

    def test_cross_process_dead_peer_is_reported(self) -> None:
        """A write to a peer process that was killed fails (TransferError naming the peer)."""
        with self._writing_to_a_peer_process(None, 0, REQUEST) as (src, proc, peer, descs):
            proc.kill()
            with pytest.raises(TransferError) as info:
                src.write(peer, descs).wait(self.wait_s)
            assert peer.name in str(info.value)

    def test_cross_process_frozen_peer_meets_the_deadline(self) -> None:
        """A receiver process that stops answering (SIGSTOP): a write with a deadline ends
        within `deadline_s + drain_s`, and once it has ended no byte lands in the receiver's
        memory after it resumes (watched for `settle_s`), whatever it held buffered; with
        `ends_are_final=False`, none once a notification posted after it landed there."""
        with self._writing_to_a_peer_process(None, 0, REQUEST) as (src, proc, peer, descs):
            src.write(peer, descs).wait(self.wait_s)  # the connection is up
            filled = proc.ask(Fill(SENTINEL))  # so that the next write's bytes show
            assert filled.ok, filled.error
            with proc.frozen():
                started = time.monotonic()
                t = src.write(peer, descs, notify=note(src), timeout=self.deadline_s)
                deadline = started + self.deadline_s + self.drain_s
                while t.poll() is Status.PENDING and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert t.poll() is not Status.PENDING, (
                    f"still pending {time.monotonic() - started:.1f} s after a "
                    f"{self.deadline_s} s deadline"
                )
                ended = peer_memory(proc.pid, peer.manifest)  # still stopped
                final = src.capabilities.ends_are_final
                if not final:
                    post_end(src, peer)  # queued behind the write's bytes
            if final:
                assert proc.ask(Drain()).ok  # it runs again
            else:  # it runs again, and what it held buffered lands before the notification
                await_end(lambda t: [m for _, m in proc.ask(Drain(timeout=t)).notes], self.wait_s)
                ended = peer_memory(proc.pid, peer.manifest)
            time.sleep(self.settle_s)
            late = int(np.count_nonzero(peer_memory(proc.pid, peer.manifest) != ended))
            assert late == 0, (
                f"{late} bytes landed in the receiver within {self.settle_s} s of its resuming, "
                f"after the sender had reported the write {t.poll().value} "
                f"({t.error if t.error is not None else 'no error'})"
            )

    def test_cross_process_peer_killed_mid_transfer(self, batches: str) -> None:
        """Many small batches to a peer process that dies half way: every write ends (a
        failure naming the peer), none hangs."""
        spec = RegionSpec(pool="raw", name="buf", layer=0, shape=(1 << 16,), itemsize=1)
        slots = np.arange(512)
        request = {"raw": (slots, slots[::-1])}
        extra = self.batch_options(batches, 16)
        with self._writing_to_a_peer_process([spec], 512, request, **extra) as (
            src,
            proc,
            peer,
            descs,
        ):
            ts = [src.write(peer, d) for d in in_batches(batches, descs, 16)]
            proc.kill()
            for t in ts:
                try:
                    t.wait(self.wait_s)
                except TransferError as exc:
                    assert peer.name in str(exc)
                assert t.poll() in (Status.FAILED, Status.DONE)
