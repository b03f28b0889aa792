"""The conformance kit's in-process tests: both backends of every write live in this process.

Each test's docstring states the obligation it checks, first sentence first:
``python -m xferkit.testing.conformance --table`` turns them into the table of
docs/plugins.md.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..backend import Backend
from ..descriptors import Descriptors
from ..driver import Capabilities, Status
from ..errors import CapabilityError, RegistrationError, TransferError, XferError
from ..manifest import Manifest, Region
from .checks import handoff
from .kit import (
    DST_SLOTS,
    REQUEST,
    SRC_SLOTS,
    KitBase,
    await_end,
    buffers,
    drain_until,
    gdn_hybrid_specs,
    held,
    in_batches,
    open_fds,
    post_end,
    raw_manifest,
)
from .pairs import Pair, close_all, connected_pair
from .reference import Reference


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


def _one(src: np.ndarray, dst: np.ndarray, nbytes: int) -> Descriptors:
    return Descriptors(
        np.array([src.ctypes.data], np.uint64),
        np.array([dst.ctypes.data], np.uint64),
        np.array([nbytes], np.uint64),
    )


class InProcessConformance(KitBase):
    """What a driver must do with both backends in one process."""

    # -- declaration ------------------------------------------------------------

    def test_capabilities_are_declared(self) -> None:
        """Capabilities are a `Capabilities` within the known memory kinds; the name is the
        backend's."""
        with self.open() as b:
            caps = b.capabilities
            assert isinstance(caps, Capabilities)
            assert caps.memory and caps.memory <= {"cpu", "cuda"}
            assert caps.max_batch >= 0
            assert b.name == self.backend

    # -- registration -----------------------------------------------------------

    def test_register_deregister_roundtrip(self) -> None:
        """Registration works, a second one is refused, deregister is idempotent and really
        releases the memory (it registers again)."""
        m = raw_manifest(buffers([4096, 100, 65536], 1), "r")
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
        """cuda memory is refused by the core when undeclared; when declared, your driver
        refuses a bogus GPU address (RegistrationError naming the region)."""
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

    @contextlib.contextmanager
    def _pair(self) -> Iterator[Pair]:
        """Two backends of this driver, ``a`` connected to ``b``; both closed on the way out."""
        srcs, dsts = buffers([8192, 3000, 65536], 10), buffers([16384, 777, 65536], 11)
        with connected_pair(self.open, srcs, dsts, pool="raw") as pair:
            yield pair

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_random_descriptors_are_byte_exact(self, data: st.DataObject) -> None:
        """Hypothesis-generated descriptor sets (any offsets, sizes, order) land byte-exact."""
        with self._pair() as p:
            copies = data.draw(_copies([x.size for x in p.srcs], [x.size for x in p.dsts]))
            want = [x.copy() for x in p.dsts]
            for s, so, d, do, n in copies:
                want[d][do : do + n] = p.srcs[s][so : so + n]
            descs = Descriptors(
                np.array([p.srcs[s].ctypes.data + so for s, so, *_ in copies], np.uint64),
                np.array([p.dsts[d].ctypes.data + do for _, _, d, do, _ in copies], np.uint64),
                np.array([c[4] for c in copies], np.uint64),
            )
            p.a.write(p.peer, descs).wait(self.wait_s)
            for got, exp in zip(p.dsts, want, strict=True):
                np.testing.assert_array_equal(got, exp)

    def test_heterogeneous_plan_through_backend(self) -> None:
        """A GDN hybrid, prefill TP 2 -> decode TP 4, planned and written by your driver,
        matches the reference model byte for byte."""
        ref = Reference(
            gdn_hybrid_specs(), src_tp=2, dst_tp=4, src_slots=SRC_SLOTS, dst_slots=DST_SLOTS
        )
        opened: list[Backend] = []
        try:
            for _ in ref.srcs + ref.dsts:
                opened.append(self.open())
            srcs, dsts = opened[: len(ref.srcs)], opened[len(ref.srcs) :]
            for backend, rank in zip(opened, ref.srcs + ref.dsts, strict=True):
                backend.register(rank.manifest)

            def write(s: int, d: int, descs: Descriptors) -> None:
                peer = srcs[s].connect(dsts[d].endpoint(), ref.dsts[d].manifest)
                srcs[s].write(peer, descs).wait(self.wait_s)

            counts = handoff(ref, REQUEST, write=write)
            assert sorted(counts) == list(range(len(ref.dsts))) and all(counts.values())
        finally:
            close_all(*opened)

    def test_notifications_follow_the_data(self) -> None:
        """When a notification can be seen, its write's data is already in place (checked at
        that moment), it names the sender, and a notification alone arrives."""
        with self._pair() as p:
            a, b, peer = p.a, p.b, p.peer
            descs = _one(p.srcs[2], p.dsts[2], p.srcs[2].size)
            if not a.capabilities.notifications:
                with pytest.raises(CapabilityError):
                    a.write(peer, descs, notify=b"done")
                pytest.skip(f"{self.backend} declares no notifications (refused, as it should)")
            for round in range(5):
                p.dsts[2][:] = 0
                t = a.write(peer, descs, notify=b"req-%d" % round)
                notes = drain_until(b, 1, self.wait_s, while_polling=t)
                got = p.dsts[2].copy()  # before anything else can land
                assert [n.message for n in notes] == [b"req-%d" % round]
                assert notes[0].peer == f"{a.name}:{a.driver.address}"
                np.testing.assert_array_equal(got, p.srcs[2])
                t.wait(self.wait_s)
            a.write(peer, Descriptors.empty(), notify=b"alone").wait(self.wait_s)
            assert [n.message for n in drain_until(b, 1, self.wait_s)] == [b"alone"]

    def test_failure_names_the_peer_and_recovery_works(self) -> None:
        """A write to a closed peer fails (TransferError naming it); the same memory behind a
        new backend is reachable again (no blacklist)."""
        with self._pair() as p:
            p.b.close()  # the peer goes away
            descs = _one(p.srcs[0], p.dsts[0], 1024)
            t = p.a.write(p.peer, descs)
            with pytest.raises(TransferError) as info:
                t.wait(self.wait_s)
            assert t.poll() is Status.FAILED and t.error is info.value
            assert p.peer.name in str(info.value)
            with self.open() as b2:
                b2.register(p.manifest)
                peer2 = p.a.connect(b2.endpoint(), p.manifest)
                p.a.write(peer2, descs).wait(self.wait_s)
                np.testing.assert_array_equal(p.dsts[0][:1024], p.srcs[0][:1024])

    def test_close_releases_everything(self) -> None:
        """close() is idempotent, later calls raise, and the memory registers anew elsewhere."""
        with self._pair() as p:
            m = held(p.a)
            p.b.close()
            p.a.close()
            p.a.close()  # idempotent
            with pytest.raises(XferError):
                p.a.register(m)
            with self.open() as again:  # the memory is free to register anew
                again.register(m)

    # -- teardown while batches run ---------------------------------------------------

    @contextlib.contextmanager
    def _many_batches(
        self, batches: str
    ) -> Iterator[tuple[Backend, Backend, Any, list[Descriptors], np.ndarray]]:
        """A pair writing 32 MiB as 4096 shuffled 8 KiB pieces: 8 writes of 512 (which your
        declared ``max_batch`` splits further), or (``split``) one write the core splits into
        batches of 64; the writes not yet started."""
        src, dst = buffers([32 << 20], 20)[0], np.zeros(32 << 20, dtype=np.uint8)
        n, size = 4096, 8 << 10
        order = np.random.default_rng(3).permutation(n).astype(np.uint64)
        descs = Descriptors(
            np.uint64(src.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size),
            np.uint64(dst.ctypes.data) + order * np.uint64(size),
            np.full(n, size, dtype=np.uint64),
        )
        extra = self.batch_options(batches, 64)
        with connected_pair(lambda: self.open(**extra), [src], [dst], receiver=self.open) as p:
            yield (
                p.a,
                p.b,
                p.peer,
                in_batches(batches, descs, 64 if batches == "split" else 512),
                dst,
            )

    def test_closing_the_sender_mid_transfer_ends_it(self, batches: str) -> None:
        """The sender's close() while batches run ends every write (terminal, a failure naming
        the peer) before it releases memory: no crash."""
        with self._many_batches(batches) as (a, _b, peer, writes, _):
            ts = [a.write(peer, d) for d in writes]
            a.close()
            for t in ts:
                assert t.poll() in (Status.FAILED, Status.DONE)
                if t.poll() is Status.FAILED:
                    assert t.error is not None and peer.name in str(t.error)

    def test_closing_the_receiver_mid_transfer_fails_it(self, batches: str) -> None:
        """The receiver's close() while batches run: every write ends (no hang), a failure
        names the peer, and the sender still closes promptly."""
        with self._many_batches(batches) as (a, b, peer, writes, _):
            ts = [a.write(peer, d) for d in writes]
            b.close()
            deadline = time.monotonic() + self.wait_s
            for t in ts:
                while t.poll() is Status.PENDING and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert t.poll() in (Status.FAILED, Status.DONE), "pending after the peer closed"
                if t.poll() is Status.FAILED:
                    assert t.error is not None and peer.name in str(t.error)
            started = time.monotonic()
            a.close()
            assert time.monotonic() - started < self.wait_s

    @pytest.mark.parametrize("stop", ["abort", "disconnect", "deregister"])
    def test_stopping_mid_transfer_means_no_more_bytes_land(self, stop: str, batches: str) -> None:
        """Once a write is terminal (aborted, its peer disconnected, its memory deregistered)
        the destination stops changing: your `Posted` reports PENDING while your engine may
        still write. Declaring `ends_are_final=False`, after an abort: once a notification
        posted after it landed (what the Session waits for)."""
        with self._many_batches(batches) as (a, b, peer, writes, dst):
            ts = [a.write(peer, d) for d in writes]
            if stop == "abort":
                for t in ts:
                    t.abort()
            else:
                {"disconnect": lambda: a.disconnect(peer), "deregister": a.deregister}[stop]()
            why = {"disconnect": "disconnected", "deregister": "deregistered"}.get(stop)
            for t in ts:
                assert t.poll() in (Status.FAILED, Status.DONE)
                if t.poll() is Status.FAILED and why is not None:
                    assert why in str(t.error)
            if not a.capabilities.ends_are_final and stop == "abort":
                post_end(a, peer)
                await_end(lambda t: [n.message for n in b.notifications(t)], self.wait_s)
            snapshot = dst.copy()
            time.sleep(0.2)
            np.testing.assert_array_equal(dst, snapshot)

    def test_a_fenced_sender_lands_nothing_more(self) -> None:
        """With `fencing` declared, once the receiver's `fence(source)` returns no byte of
        that sender lands, whatever it had in flight, its writes end (at their deadline at
        the latest, as a Session's do), and a connection made from the receiver's new
        endpoint works; without it `fence` raises `CapabilityError`."""
        with self._many_batches("many") as (a, b, peer, writes, dst):
            source = f"{a.name}:{a.driver.address}"  # as the receiver's notifications name it
            if not b.capabilities.fencing:
                with pytest.raises(CapabilityError):
                    b.fence(source)
                return
            # NIXL over TCP: a write towards a fenced agent was seen to hang 30 s (3 full runs
            # of 4, never alone); a Session's writes carry their request's deadline.
            ts = [a.write(peer, d, timeout=self.wait_s / 3) for d in writes]
            p_endpoint = b.endpoint()
            b.fence(source)
            fenced = dst.copy()
            deadline = time.monotonic() + self.wait_s
            for t in ts:
                while t.poll() is Status.PENDING and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert t.poll() is not Status.PENDING, "a fenced sender's write never ended"
            time.sleep(0.2)
            np.testing.assert_array_equal(dst, fenced)
            assert b.endpoint() != p_endpoint, "the endpoint did not change with the fence"
            again = a.connect(b.endpoint(), peer.manifest)  # made from the new endpoint
            a.write(again, writes[-1]).wait(self.wait_s)  # the last: it cannot have landed
            assert not np.array_equal(dst, fenced)

    def test_a_stale_endpoint_is_refused(self) -> None:
        """After the receiver deregisters and registers again, writes through an endpoint from
        before fail and land nothing (as a NIC refuses a stale remote key); the new one works."""
        with self._pair() as p:
            p.b.deregister()
            p.b.register(p.manifest)
            before = p.dsts[0].copy()
            descs = _one(p.srcs[0], p.dsts[0], 1024)
            with pytest.raises(TransferError):
                p.a.write(p.peer, descs).wait(self.wait_s)
            np.testing.assert_array_equal(p.dsts[0], before)
            fresh = p.a.connect(p.b.endpoint(), p.manifest)  # the new endpoint works
            p.a.write(fresh, descs).wait(self.wait_s)
            np.testing.assert_array_equal(p.dsts[0][:1024], p.srcs[0][:1024])

    def test_notified_writes_complete_before_the_receiver_drains(self) -> None:
        """300 notified writes complete although the receiver drains only afterwards: you queue
        notifications, none is lost, none holds a write back."""
        with self._pair() as p:
            if not p.a.capabilities.notifications:
                pytest.skip(f"{self.backend} declares no notifications")
            base_s, base_d = p.srcs[2].ctypes.data, p.dsts[2].ctypes.data
            transfers = [
                p.a.write(
                    p.peer,
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
            notes = drain_until(p.b, 300, self.wait_s)
            assert sorted(int(n.message) for n in notes) == list(range(300))
            np.testing.assert_array_equal(p.dsts[2][: 64 * 300], p.srcs[2][: 64 * 300])

    def test_errors_after_close_say_closed(self) -> None:
        """A write or a drain after close() raises an XferError saying "closed"."""
        with self._pair() as p:
            p.a.close()
            p.b.close()
            with pytest.raises(XferError, match="closed"):
                p.a.write(p.peer, Descriptors.empty())
            with pytest.raises(XferError, match="closed"):
                p.b.notifications()

    def test_connect_disconnect_cycles_leak_no_descriptors(self) -> None:
        """100 connect/disconnect cycles leave the process's open file descriptors as they
        were (give back sockets and engine handles in disconnect)."""
        with self._pair() as p:
            p.a.disconnect(p.a.connect(p.endpoint, p.manifest))  # warm: first costs aren't leaks
            before = open_fds()
            for _ in range(100):
                p.a.disconnect(p.a.connect(p.endpoint, p.manifest))
            assert open_fds() <= before + 4, "file descriptors grow with connect/disconnect"
