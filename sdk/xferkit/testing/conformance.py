"""The conformance kit: what a driver must do, as pytest tests.

The core's own guards (bounds, rollback, the empty filter, splitting) are
tested once, in xferkit's suite, against ``xferkit.testing.mock``; this kit
runs your driver for real and checks what only a driver can get wrong.

Point it at a backend by subclassing in your plugin's tests::

    from xferkit.testing.conformance import BackendConformance

    class TestMyDriver(BackendConformance):
        backend = "mydriver"
        options = {"device": "lo"}

The tests use real memory (numpy buffers) and the reference model; they run
the driver for real, in this process and, when it claims cross-process
support, against a peer process.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..backend import Backend, Peer
from ..descriptors import Descriptors
from ..driver import Capabilities, Status
from ..errors import CapabilityError, RegistrationError, TransferError, XferError
from ..manifest import Manifest, Region
from ..planner import coverage
from ..plugins import backends, open_backend
from .checks import handoff
from .memory import manifest_of, random_bytes
from .models import gdn_hybrid
from .peer import Check, Drain, PeerProcess, Reply, Setup, Write, reference
from .reference import Reference, RegionSpec


def gdn_hybrid_specs() -> list[RegionSpec]:
    """The kit's model: a small GDN hybrid (see ``xferkit.testing.models.gdn_hybrid``)."""
    return gdn_hybrid(4)


SRC_SLOTS, DST_SLOTS = {"kv": 24, "state": 6}, {"kv": 32, "state": 6}
REQUEST = {"kv": ([3, 4, 5, 9, 20], [0, 1, 2, 30, 7]), "state": ([2], [5])}


def _buffers(sizes: list[int], seed: int) -> list[np.ndarray]:
    return [random_bytes(n, seed * 1000 + i) for i, n in enumerate(sizes)]


def _manifest(buffers: list[np.ndarray], name: str) -> Manifest:
    return manifest_of(buffers, name, pool="raw")


@st.composite
def _copies(draw: st.DrawFn, src_sizes: list[int], dst_sizes: list[int]):
    """Disjoint destination ranges, each fed from a random source range.

    Yields tuples (src buffer, src offset, dst buffer, dst offset, nbytes).
    """
    out = []
    for d, size in enumerate(dst_sizes):
        cuts = sorted({*draw(st.lists(st.integers(1, size - 1), max_size=12)), 0, size})
        for lo, hi in itertools.pairwise(cuts):
            if not draw(st.booleans()):
                continue
            s = draw(st.integers(0, len(src_sizes) - 1))
            n = min(hi - lo, src_sizes[s])
            so = draw(st.integers(0, src_sizes[s] - n))
            out.append((s, so, d, lo, n))
    return out


class BackendConformance:
    """Subclass with ``backend`` (a registered backend name) and ``options``."""

    backend: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    wait_s: ClassVar[float] = 30.0
    deadline_s: ClassVar[float] = 2.0
    """The deadline the frozen-peer test gives a write."""
    drain_s: ClassVar[float] = 10.0
    """How long after its deadline a write may take to end (the driver letting go of it)."""
    batch_option: ClassVar[str | None] = "max_batch"
    """The option that sets your driver's batch limit (None: it has none; those tests skip)."""

    def open(self, **extra: Any) -> Backend:
        return open_backend(self.backend, **{**self.options, **extra})

    # -- declaration ------------------------------------------------------------

    def test_capabilities_are_declared(self) -> None:
        with self.open() as b:
            caps = b.capabilities
            assert isinstance(caps, Capabilities)
            assert caps.memory and caps.memory <= {"cpu", "cuda"}
            assert caps.max_batch >= 0
            assert b.name == self.backend

    # -- registration -----------------------------------------------------------

    def test_register_deregister_roundtrip(self) -> None:
        bufs = _buffers([4096, 100, 65536], 1)
        m = _manifest(bufs, "r")
        with self.open() as b:
            b.register(m)
            assert b.manifest is m
            with pytest.raises(RegistrationError):
                b.register(m)
            b.deregister()
            b.deregister()  # idempotent
            assert b.manifest is None
            b.register(m)  # everything was released: the same memory registers again
            assert b.manifest is m

    def test_memory_kinds_are_checked_up_front(self) -> None:
        """cuda memory: refused by the core when undeclared, left to the driver when declared."""
        with self.open() as b:
            region = Region(
                pool="p",
                name="gpu",
                layer=0,
                addr=1 << 40,
                nbytes=64,
                slot_shape=(64,),
                itemsize=1,
                device="cuda:0",
            )
            if "cuda" in b.capabilities.memory:
                # Declared: the driver judges it, and no GPU allocation lives at 1 TiB.
                with pytest.raises(RegistrationError, match="gpu"):
                    b.register(Manifest.build([region]))
                assert b.manifest is None
                return
            with pytest.raises(CapabilityError, match="gpu"):
                b.register(Manifest.build([region]))
            assert b.manifest is None

    # -- writes -----------------------------------------------------------------

    def _pair(self) -> tuple[Backend, Backend, list[np.ndarray], list[np.ndarray]]:
        src_bufs = _buffers([8192, 3000, 65536], 10)
        dst_bufs = _buffers([16384, 777, 65536], 11)
        a, b = self.open(), self.open()
        a.register(_manifest(src_bufs, "src"))
        b.register(_manifest(dst_bufs, "dst"))
        return a, b, src_bufs, dst_bufs

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_random_descriptors_are_byte_exact(self, data: st.DataObject) -> None:
        a, b, src_bufs, dst_bufs = self._pair()
        try:
            copies = data.draw(_copies([x.size for x in src_bufs], [x.size for x in dst_bufs]))
            want = [x.copy() for x in dst_bufs]
            for s, so, d, do, n in copies:
                want[d][do : do + n] = src_bufs[s][so : so + n]
            descs = Descriptors(
                np.array([src_bufs[s].ctypes.data + so for s, so, *_ in copies], np.uint64),
                np.array([dst_bufs[d].ctypes.data + do for _, _, d, do, _ in copies], np.uint64),
                np.array([c[4] for c in copies], np.uint64),
            )
            peer = a.connect(b.endpoint(), held(b))
            a.write(peer, descs).wait(self.wait_s)
            for got, exp in zip(dst_bufs, want, strict=True):
                np.testing.assert_array_equal(got, exp)
        finally:
            a.close()
            b.close()

    def test_heterogeneous_plan_through_backend(self) -> None:
        """The planner's TP 2 -> 4 descriptors, written by the driver: the reference's checks."""
        ref = Reference(
            gdn_hybrid_specs(), src_tp=2, dst_tp=4, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
        )
        srcs = [self.open() for _ in ref.srcs]
        dsts = [self.open() for _ in ref.dsts]
        try:
            for backend, rank in zip(srcs + dsts, ref.srcs + ref.dsts, strict=True):
                backend.register(rank.manifest)

            def write(s: int, d: int, descs: Descriptors) -> None:
                peer = srcs[s].connect(dsts[d].endpoint(), ref.dsts[d].manifest)
                srcs[s].write(peer, descs).wait(self.wait_s)

            counts = handoff(ref, REQUEST, write=write)
            assert sorted(counts) == list(range(len(ref.dsts))) and all(counts.values())
        finally:
            for backend in srcs + dsts:
                backend.close()

    def test_notifications_follow_the_data(self) -> None:
        """When the notification can be seen, the data is in place: checked at that moment."""
        a, b, src_bufs, dst_bufs = self._pair()
        with a, b:
            peer = a.connect(b.endpoint(), held(b))
            descs = Descriptors(
                np.array([src_bufs[2].ctypes.data], np.uint64),
                np.array([dst_bufs[2].ctypes.data], np.uint64),
                np.array([src_bufs[2].size], np.uint64),
            )
            if not a.capabilities.notifications:
                with pytest.raises(CapabilityError):
                    a.write(peer, descs, notify=b"done")
                pytest.skip(f"{self.backend} declares no notifications (refused, as it should)")
            for round in range(5):
                dst_bufs[2][:] = 0
                t = a.write(peer, descs, notify=b"req-%d" % round)
                notes = drain_until(b, 1, self.wait_s, while_polling=t)
                got = dst_bufs[2].copy()  # before anything else can land
                assert [n.message for n in notes] == [b"req-%d" % round]
                assert notes[0].peer == f"{a.name}:{a.driver.address}"
                np.testing.assert_array_equal(got, src_bufs[2])
                t.wait(self.wait_s)
            a.write(peer, Descriptors.empty(), notify=b"alone").wait(self.wait_s)
            assert [n.message for n in drain_until(b, 1, self.wait_s)] == [b"alone"]

    def test_failure_names_the_peer_and_recovery_works(self) -> None:
        a, b, src_bufs, dst_bufs = self._pair()
        with a:
            dst_manifest = held(b)
            peer = a.connect(b.endpoint(), dst_manifest)
            b.close()  # the peer goes away
            descs = Descriptors(
                np.array([src_bufs[0].ctypes.data], np.uint64),
                np.array([dst_bufs[0].ctypes.data], np.uint64),
                np.array([1024], np.uint64),
            )
            t = a.write(peer, descs)
            with pytest.raises(TransferError) as info:
                t.wait(self.wait_s)
            assert t.poll() is Status.FAILED and t.error is info.value
            assert peer.name in str(info.value)
            # A recovered peer (same memory, new backend) is reachable again: no blacklist.
            with self.open() as b2:
                b2.register(dst_manifest)
                peer2 = a.connect(b2.endpoint(), dst_manifest)
                a.write(peer2, descs).wait(self.wait_s)
                np.testing.assert_array_equal(dst_bufs[0][:1024], src_bufs[0][:1024])

    def test_close_releases_everything(self) -> None:
        a, b, _, _ = self._pair()
        m = held(a)
        b.close()
        a.close()
        a.close()  # idempotent
        with pytest.raises(XferError):
            a.register(m)
        with self.open() as again:  # the memory is free to register anew
            again.register(m)

    # -- teardown while batches run ---------------------------------------------------

    def _many_batches(self) -> tuple[Backend, Backend, Any, Descriptors, list[np.ndarray]]:
        """A pair whose source splits a 32 MiB write into about a hundred small batches."""
        if self.batch_option is None:
            pytest.skip(f"{self.backend} has no batch-size option to split writes with")
        src_bufs = _buffers([32 << 20], 20)
        dst_bufs = [np.zeros(32 << 20, dtype=np.uint8)]
        a = self.open(**{self.batch_option: 64})
        b = self.open()
        a.register(_manifest(src_bufs, "src"))
        b.register(_manifest(dst_bufs, "dst"))
        peer = a.connect(b.endpoint(), held(b))
        n, size = 4096, 8 << 10
        order = np.random.default_rng(3).permutation(n).astype(np.uint64)
        descs = Descriptors(
            np.uint64(src_bufs[0].ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size),
            np.uint64(dst_bufs[0].ctypes.data) + order * np.uint64(size),
            np.full(n, size, dtype=np.uint64),
        )
        return a, b, peer, descs, dst_bufs

    def test_closing_the_sender_mid_transfer_ends_it(self) -> None:
        """close() ends every transfer before releasing memory: no crash, a terminal state."""
        a, b, peer, descs, _ = self._many_batches()
        with b:
            t = a.write(peer, descs)
            a.close()
            assert t.poll() in (Status.FAILED, Status.DONE)
            if t.poll() is Status.FAILED:
                assert t.error is not None and peer.name in str(t.error)

    def test_closing_the_receiver_mid_transfer_fails_it(self) -> None:
        a, b, peer, descs, _ = self._many_batches()
        with a:
            t = a.write(peer, descs)
            b.close()
            deadline = time.monotonic() + self.wait_s
            while t.poll() is Status.PENDING and time.monotonic() < deadline:
                time.sleep(0.001)
            assert t.poll() in (Status.FAILED, Status.DONE), "still pending after the peer closed"
            if t.poll() is Status.FAILED:
                assert t.error is not None and peer.name in str(t.error)
            # Nothing stays stuck: the sender closes promptly.
            started = time.monotonic()
            a.close()
            assert time.monotonic() - started < self.wait_s

    @pytest.mark.parametrize("stop", ["abort", "disconnect", "deregister"])
    def test_stopping_mid_transfer_means_no_more_bytes_land(self, stop: str) -> None:
        """Once a write is terminal the destination stops changing, however it was stopped."""
        a, b, peer, descs, dst_bufs = self._many_batches()
        with a, b:
            t = a.write(peer, descs)
            {
                "abort": t.abort,
                "disconnect": lambda: a.disconnect(peer),
                "deregister": a.deregister,
            }[stop]()
            assert t.poll() in (Status.FAILED, Status.DONE)
            if t.poll() is Status.FAILED and stop != "abort":
                assert {"disconnect": "disconnected", "deregister": "deregistered"}[stop] in str(
                    t.error
                )
            snapshot = dst_bufs[0].copy()
            time.sleep(0.2)
            np.testing.assert_array_equal(dst_bufs[0], snapshot)

    def test_a_stale_endpoint_is_refused(self) -> None:
        """The peer deregistered and registered again: writes through its old endpoint fail."""
        a, b, src_bufs, dst_bufs = self._pair()
        with a, b:
            m = held(b)
            peer = a.connect(b.endpoint(), m)
            b.deregister()
            b.register(m)
            before = dst_bufs[0].copy()
            descs = Descriptors(
                np.array([src_bufs[0].ctypes.data], np.uint64),
                np.array([dst_bufs[0].ctypes.data], np.uint64),
                np.array([1024], np.uint64),
            )
            with pytest.raises(TransferError):
                a.write(peer, descs).wait(self.wait_s)
            np.testing.assert_array_equal(dst_bufs[0], before)
            fresh = a.connect(b.endpoint(), m)  # the new endpoint works
            a.write(fresh, descs).wait(self.wait_s)
            np.testing.assert_array_equal(dst_bufs[0][:1024], src_bufs[0][:1024])

    def test_notified_writes_complete_before_the_receiver_drains(self) -> None:
        """Drivers queue notifications: a receiver that drains late loses nothing, fails nothing."""
        a, b, src_bufs, dst_bufs = self._pair()
        with a, b:
            if not a.capabilities.notifications:
                pytest.skip(f"{self.backend} declares no notifications")
            peer = a.connect(b.endpoint(), held(b))
            base_s, base_d = src_bufs[2].ctypes.data, dst_bufs[2].ctypes.data
            transfers = [
                a.write(
                    peer,
                    Descriptors(
                        np.array([base_s + 64 * i], np.uint64),
                        np.array([base_d + 64 * i], np.uint64),
                        np.array([64], np.uint64),
                    ),
                    notify=b"%d" % i,
                )
                for i in range(300)
            ]
            for t in transfers:
                t.wait(self.wait_s)
            notes = drain_until(b, 300, self.wait_s)
            assert sorted(int(n.message) for n in notes) == list(range(300))
            np.testing.assert_array_equal(dst_bufs[2][: 64 * 300], src_bufs[2][: 64 * 300])

    def test_errors_after_close_say_closed(self) -> None:
        a, b, _, _ = self._pair()
        peer = a.connect(b.endpoint(), held(b))
        a.close()
        b.close()
        with pytest.raises(XferError, match="closed"):
            a.write(peer, Descriptors.empty())
        with pytest.raises(XferError, match="closed"):
            b.notifications()

    def test_connect_disconnect_cycles_leak_no_descriptors(self) -> None:
        a, b, _, _ = self._pair()
        with a, b:
            m = held(b)
            endpoint = b.endpoint()
            a.disconnect(a.connect(endpoint, m))  # warm: first-connection costs are not leaks
            before = _open_fds()
            for _ in range(100):
                a.disconnect(a.connect(endpoint, m))
            assert _open_fds() <= before + 4, "file descriptors grow with connect/disconnect"

    # -- another process ----------------------------------------------------------

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
        backends = [self.open() for _ in here]
        try:
            with PeerProcess() as peer_proc:
                ready = peer_proc.ask(setup)
                assert ready.ok, ready.error
                for backend, rank in zip(backends, here, strict=True):
                    backend.register(rank.manifest)
                yield ready, ref, backends, peer_proc
        finally:
            for backend in backends:
                backend.close()

    def _cross_process(self) -> None:
        """Skip (never pass) unless the driver claims cross-process; if not, it must refuse."""
        with self.open() as b:
            if b.capabilities.cross_process:
                return
            with pytest.raises(CapabilityError), PeerProcess() as p:
                r = p.ask(self._setup("dst", 0, 1, 1))
                b.register(_manifest(_buffers([64], 0), "x"))
                b.connect(r.endpoint, Manifest.decode(r.manifest))
        pytest.skip(f"{self.backend} declares no cross-process support (refused, as it should)")

    def test_cross_process_write_into_peer(self) -> None:
        """This process holds prefill TP 2; a peer process is decode rank 1 of TP 4."""
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
        """A peer process is prefill rank 0 of TP 1 and writes into this process (decode TP 2)."""
        with self._ranks_beside_a_peer("src", 0, 1, 2) as (_, ref, dsts, peer_proc):
            for i, (backend, rank) in enumerate(zip(dsts, ref.dsts, strict=True)):
                w = Write(
                    endpoint=backend.endpoint(), manifest=rank.manifest.encode(), slots=REQUEST
                )
                reply = peer_proc.ask(w)
                assert reply.ok, reply.error
                ref.check(i, REQUEST)

    def test_cross_process_every_rank_in_its_own_process(self) -> None:
        """Prefill TP 2 -> decode TP 4 with no two ranks sharing a process, as deployed."""
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
        with self._writing_to_a_peer_process(None, 0, REQUEST) as (src, proc, peer, descs):
            proc.kill()
            with pytest.raises(TransferError) as info:
                src.write(peer, descs).wait(self.wait_s)
            assert peer.name in str(info.value)

    def test_cross_process_frozen_peer_meets_the_deadline(self) -> None:
        """A peer that stops answering (SIGSTOP): a write with a deadline ends in time."""
        with self._writing_to_a_peer_process(None, 0, REQUEST) as (src, proc, peer, descs):
            src.write(peer, descs).wait(self.wait_s)  # the connection is up
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                t = src.write(peer, descs, notify=_note(src), timeout=self.deadline_s)
                deadline = started + self.deadline_s + self.drain_s
                while t.poll() is Status.PENDING and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert t.poll() is not Status.PENDING, (
                    f"still pending {time.monotonic() - started:.1f} s after a "
                    f"{self.deadline_s} s deadline"
                )
            finally:
                os.kill(proc.pid, signal.SIGCONT)

    def test_cross_process_peer_killed_mid_transfer(self) -> None:
        """Many small batches to a peer process that dies half way: it ends, naming the peer."""
        if self.batch_option is None:
            pytest.skip(f"{self.backend} has no batch-size option to split writes with")
        spec = RegionSpec(pool="raw", name="buf", layer=0, shape=(1 << 16,), itemsize=1)
        slots = np.arange(512)
        request = {"raw": (slots, slots[::-1])}
        batches = {self.batch_option: 16}
        with self._writing_to_a_peer_process([spec], 512, request, **batches) as (
            src,
            proc,
            peer,
            descs,
        ):
            t = src.write(peer, descs)
            proc.kill()
            try:
                t.wait(self.wait_s)
            except TransferError as exc:
                assert peer.name in str(exc)
            assert t.poll() in (Status.FAILED, Status.DONE)


def require_backend(name: str) -> None:
    """Skip the calling test module unless backend ``name`` is usable here, with the reason
    ``xferkit.backends()`` gives (the probe's own words: what to install)."""
    info = next((b for b in backends() if b.name == name), None)
    if info is None or not info.available:
        why = "no such backend is installed" if info is None else info.reason
        pytest.skip(f"backend {name!r} is not usable here: {why}", allow_module_level=True)


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


def _note(backend: Backend) -> bytes | None:
    return b"n" if backend.capabilities.notifications else None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def held(backend: Backend) -> Manifest:
    """The manifest a backend registered (the kit registers before it asks)."""
    assert backend.manifest is not None
    return backend.manifest


def drain_until(backend: Backend, count: int, timeout: float, while_polling: Any = None) -> list:
    """Notifications until ``count`` arrived or ``timeout``; polls a sender's transfer meanwhile."""
    notes: list = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        if while_polling is not None:
            while_polling.poll()  # a split write progresses while its sender polls
        notes += backend.notifications(timeout=0.01)
    return notes
