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

import itertools
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..backend import Backend
from ..descriptors import Descriptors
from ..driver import Capabilities, Status
from ..errors import CapabilityError, RegistrationError, TransferError, XferError
from ..manifest import Manifest, Region
from ..planner import coverage
from ..plugins import open_backend
from .models import gdn_hybrid
from .peer import Check, Drain, PeerProcess, Setup, Write
from .reference import Reference, RegionSpec


def gdn_hybrid_specs() -> list[RegionSpec]:
    """The kit's model: a small GDN hybrid (see ``xferkit.testing.models.gdn_hybrid``)."""
    return gdn_hybrid(4)


SRC_SLOTS, DST_SLOTS = {"kv": 24, "state": 6}, {"kv": 32, "state": 6}
REQUEST = {"kv": ([3, 4, 5, 9, 20], [0, 1, 2, 30, 7]), "state": ([2], [5])}


def _buffers(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def _manifest(buffers: list[np.ndarray], name: str) -> Manifest:
    return Manifest.build(
        [Region.from_array(b, pool=f"raw{i}", name=name, layer=0) for i, b in enumerate(buffers)]
    )


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
            peer = a.connect(b.endpoint(), _held(b))
            a.write(peer, descs).wait(self.wait_s)
            for got, exp in zip(dst_bufs, want, strict=True):
                np.testing.assert_array_equal(got, exp)
        finally:
            a.close()
            b.close()

    def test_heterogeneous_plan_through_backend(self) -> None:
        ref = Reference(
            gdn_hybrid_specs(), src_tp=2, dst_tp=4, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
        )
        srcs = [self.open() for _ in ref.srcs]
        dsts = [self.open() for _ in ref.dsts]
        try:
            for backend, rank in zip(srcs + dsts, ref.srcs + ref.dsts, strict=True):
                backend.register(rank.manifest)
            for i, rank in enumerate(ref.dsts):
                cov = coverage([r.manifest for r in ref.srcs], rank.manifest)
                for s in cov.sources:
                    peer = srcs[s].connect(dsts[i].endpoint(), rank.manifest)
                    srcs[s].write(peer, cov.plans[s].expand(REQUEST)).wait(self.wait_s)
                ref.check(i, REQUEST)
        finally:
            for backend in srcs + dsts:
                backend.close()

    def test_notifications_follow_the_data(self) -> None:
        """When the notification can be seen, the data is in place: checked at that moment."""
        a, b, src_bufs, dst_bufs = self._pair()
        with a, b:
            peer = a.connect(b.endpoint(), _held(b))
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
                notes = _drain_until(b, 1, self.wait_s, while_polling=t)
                got = dst_bufs[2].copy()  # before anything else can land
                assert [n.message for n in notes] == [b"req-%d" % round]
                assert notes[0].peer == f"{a.name}:{a.driver.address}"
                np.testing.assert_array_equal(got, src_bufs[2])
                t.wait(self.wait_s)
            a.write(peer, Descriptors.empty(), notify=b"alone").wait(self.wait_s)
            assert [n.message for n in _drain_until(b, 1, self.wait_s)] == [b"alone"]

    def test_failure_names_the_peer_and_recovery_works(self) -> None:
        a, b, src_bufs, dst_bufs = self._pair()
        with a:
            dst_manifest = _held(b)
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
        m = _held(a)
        b.close()
        a.close()
        a.close()  # idempotent
        with pytest.raises(XferError):
            a.register(m)
        with self.open() as again:  # the memory is free to register anew
            again.register(m)

    # -- another process ----------------------------------------------------------

    def _setup(self, role: str, index: int, src_tp: int, dst_tp: int) -> Setup:
        return Setup(
            backend=self.backend,
            options=dict(self.options),
            specs=gdn_hybrid_specs(),
            src_tp=src_tp,
            dst_tp=dst_tp,
            src_slots=SRC_SLOTS,
            dst_slots=DST_SLOTS,
            role=role,
            index=index,
        )

    def _cross_process(self) -> None:
        """Skip (not pass) unless the driver claims cross-process support; if not, it must refuse."""
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
        self._cross_process()
        setup = self._setup("dst", 1, 2, 4)
        ref = Reference(setup.specs, src_tp=2, dst_tp=4, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS)
        srcs = [self.open() for _ in ref.srcs]
        with PeerProcess() as peer_proc:
            try:
                ready = peer_proc.ask(setup)
                assert ready.ok, ready.error
                dst_manifest = Manifest.decode(ready.manifest)
                for backend, rank in zip(srcs, ref.srcs, strict=True):
                    backend.register(rank.manifest)
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
            finally:
                for backend in srcs:
                    backend.close()

    def test_cross_process_write_from_peer(self) -> None:
        """A peer process is prefill rank 0 of TP 1 and writes into this process (decode TP 2)."""
        self._cross_process()
        setup = self._setup("src", 0, 1, 2)
        ref = Reference(setup.specs, src_tp=1, dst_tp=2, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS)
        dsts = [self.open() for _ in ref.dsts]
        with PeerProcess() as peer_proc:
            try:
                assert peer_proc.ask(setup).ok
                for i, (backend, rank) in enumerate(zip(dsts, ref.dsts, strict=True)):
                    backend.register(rank.manifest)
                    w = Write(
                        endpoint=backend.endpoint(),
                        manifest=rank.manifest.encode(),
                        slots=REQUEST,
                    )
                    reply = peer_proc.ask(w)
                    assert reply.ok, reply.error
                    ref.check(i, REQUEST)
            finally:
                for backend in dsts:
                    backend.close()

    def test_cross_process_dead_peer_is_reported(self) -> None:
        self._cross_process()
        setup = self._setup("dst", 0, 1, 1)
        ref = Reference(setup.specs, src_tp=1, dst_tp=1, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS)
        with self.open() as src:
            src.register(ref.srcs[0].manifest)
            peer_proc = PeerProcess()
            ready = peer_proc.ask(setup)
            dst_manifest = Manifest.decode(ready.manifest)
            peer = src.connect(ready.endpoint, dst_manifest)
            peer_proc.kill()
            descs = coverage([ref.srcs[0].manifest], dst_manifest).plans[0].expand(REQUEST)
            with pytest.raises(TransferError) as info:
                src.write(peer, descs).wait(self.wait_s)
            assert peer.name in str(info.value)


def _held(backend: Backend) -> Manifest:
    """The manifest a backend registered (the kit registers before it asks)."""
    assert backend.manifest is not None
    return backend.manifest


def _drain_until(
    backend: Backend, count: int, timeout: float, while_polling: Any = None
) -> list:
    """Notifications until ``count`` arrived or ``timeout``; polls a sender's transfer meanwhile."""
    notes: list = []
    deadline = time.monotonic() + timeout
    while len(notes) < count and time.monotonic() < deadline:
        if while_polling is not None:
            while_polling.poll()  # a split write progresses while its sender polls
        notes += backend.notifications(timeout=0.01)
    return notes
