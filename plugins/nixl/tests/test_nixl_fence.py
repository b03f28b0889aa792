"""The NIXL driver's fence: when it is declared, what it cuts, and what stays working.

Every backend here runs UCX over TCP on loopback (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo``, set per test: UCX reads them at each agent's creation,
and peer processes inherit them), where destroying the receiving agent cuts
every write into it. The kit's ``test_a_fenced_sender_lands_nothing_more``
(``test_nixl_conformance.py``, both transports) checks the fence in one
process; here a sender in another process is frozen mid-write across it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import xferkit as xk
from xferkit.driver import Status
from xferkit.testing.conformance import drain_until, require_backend
from xferkit.testing.peer import PeerProcess
from xferkit.testing.reference import RegionSpec
from xferkit_nixl import backend as nixl_backend
from xferkit_nixl import sockets
from xferkit_nixl.memory import gpu_visible
from xferkit_nixl.ucx_env import fencing

require_backend("nixl")

TCP = "tcp,cuda_copy" if gpu_visible() else "tcp"
"""As in test_nixl_conformance.py: where a GPU is, NIXL refuses a UCX_TLS without cuda_copy."""


@pytest.fixture(autouse=True)
def _tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", TCP)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # 127.0.0.1 only


def _manifest(array: np.ndarray, name: str) -> xk.Manifest:
    return xk.Manifest.build([xk.Region.from_array(array, pool="p", name=name, layer=0)])


def _one(src: int, dst: int, nbytes: int) -> xk.Descriptors:
    return xk.Descriptors(*(np.array([x], np.uint64) for x in (src, dst, nbytes)))


# -- when it is declared --------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "devices", "gpus", "fences"),
    [
        (None, {}, False, False),  # UCX's default: cma on one host
        ("", {}, False, False),
        ("tcp", {}, False, True),
        (" tcp , self", {}, False, True),
        ("tcp,posix,sysv,cuda_copy", {"mlx5_0": "mlx5_core"}, True, True),  # named: all apply
        ("tcp,cma", {}, False, False),
        ("sm,tcp", {}, False, False),  # sm: cma, knem, xpmem among them
        ("tcp,rc", {}, False, False),  # RDMA: not shown here
        ("tcp,cuda_ipc", {}, True, False),  # the sender maps our GPU memory
        ("all", {}, False, False),
        ("^cma", {}, False, False),  # knem, xpmem left in force (absent here, not everywhere)
        ("^cma,knem,xpmem", {}, False, True),  # what is left here: tcp, posix, sysv, self
        ("^sm", {}, False, True),
        ("^mm,cma,knem", {}, False, True),  # mm: posix, sysv, xpmem
        ("^cma,knem,xpmem", {"mlx5_0": "mlx5_core"}, False, False),  # leaves RDMA in force
        ("^cma,knem,xpmem", {}, True, False),  # leaves cuda_ipc in force
    ],
)
def test_fencing_is_declared_only_where_no_transport_writes_by_itself(
    tls: str | None, devices: dict[str, str], gpus: bool, fences: bool
) -> None:
    got, why = fencing(tls, devices, gpus)
    assert got is fences, why
    assert why


def test_the_backend_declares_what_ucx_tls_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    with xk.open_backend("nixl") as b:
        assert b.capabilities.fencing and b.capabilities.fence_cuts_all
    monkeypatch.setenv("UCX_TLS", "tcp,cma")
    with xk.open_backend("nixl") as b:
        assert not b.capabilities.fencing and not b.capabilities.fence_cuts_all
        assert "cma" in b.driver.fence_note  # type: ignore[attr-defined]
        with pytest.raises(xk.CapabilityError):
            b.fence(f"nixl:{b.driver.address}")
    monkeypatch.setenv("UCX_TLS", TCP)
    with xk.open_backend("nixl", backends=["UCX", "POSIX"]) as b:  # shown for UCX alone
        assert not b.capabilities.fencing


# -- the agent's sockets ---------------------------------------------------------------


def test_silencing_an_agent_leaves_the_other_agents_alone() -> None:
    """The drop filter goes on the agent's own listener and connections only: a sender's
    write to it then goes unanswered while its writes to a third agent land; lifted, the
    write completes (TCP resent what was dropped); silenced again and closed, the agent
    ends the write, having landed nothing."""
    src = np.random.default_rng(1).integers(1, 256, 1 << 20, dtype=np.uint8)
    to_b, to_c = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b, xk.open_backend("nixl") as c:
        a.register(_manifest(src, "s"))
        mb, mc = _manifest(to_b, "b"), _manifest(to_c, "c")
        b.register(mb)
        c.register(mc)
        pb, pc = a.connect(b.endpoint(), mb), a.connect(c.endpoint(), mc)
        into_b = _one(src.ctypes.data, to_b.ctypes.data, src.nbytes)
        into_c = _one(src.ctypes.data, to_c.ctypes.data, src.nbytes)
        a.write(pb, into_b).wait(10)  # the connections are up
        a.write(pc, into_c).wait(10)
        owned = b.driver._sockets  # type: ignore[attr-defined]
        assert owned is not None and owned.listeners and owned.epolls
        silenced = sockets.silence(owned)
        assert len(silenced) >= 2  # its listener, and a's connection into it at least
        to_b[:], to_c[:] = 0, 0
        late = a.write(pb, into_b)
        a.write(pc, into_c).wait(10)
        np.testing.assert_array_equal(to_c, src)  # a and c untouched
        time.sleep(0.3)
        assert late.poll() is Status.PENDING and not to_b.any()  # b hears nothing any more
        sockets.unsilence(silenced)
        late.wait(10)
        np.testing.assert_array_equal(to_b, src)  # nothing was lost
        assert len(sockets.silence(owned)) >= 2
        to_b[:] = 0
        late = a.write(pb, into_b)
        time.sleep(0.3)
        assert late.poll() is Status.PENDING
        b.close()  # the agent goes: the write into it ends, and lands nothing
        with pytest.raises(xk.TransferError):
            late.wait(10)
        assert not to_b.any()


# -- what a fence cuts, what stays -------------------------------------------------------


def test_a_fence_cuts_this_backends_own_writes_and_keeps_its_peers() -> None:
    """A write of ours still running in the old agent ends FAILED, saying why, without a call
    into the destroyed agent; the agent is gone; the same Peer then works (its metadata is
    loaded into the new agent)."""
    # More than loopback TCP's socket buffers hold (tcp_wmem 4 MiB + tcp_rmem 32 MiB here):
    # a 4 MiB write to the frozen process could fit in them whole and end DONE.
    specs = [RegionSpec(pool="p", name="buf", layer=0, shape=(1 << 26,), itemsize=1)]
    src = np.full(1 << 26, 5, np.uint8)
    with PeerProcess() as proc, xk.open_backend("nixl") as b:
        endpoint, dm = proc.receiver("nixl", specs, 1)
        b.register(_manifest(src, "s"))
        peer = b.connect(endpoint, dm)
        whole = _one(src.ctypes.data, dm.regions[0].addr, src.nbytes)
        b.write(peer, whole).wait(10)  # the connection is up
        old = weakref.ref(b.driver._agent.agent)  # type: ignore[attr-defined]
        before = b.endpoint()
        with proc.frozen():
            t = b.write(peer, whole)
            time.sleep(0.3)
            assert t.poll() is Status.PENDING  # 64 MiB to a frozen process: stuck in UCX
            b.fence("nixl:a-lost-source")
            assert old() is None, "the old agent outlived the fence"
            assert t.poll() is Status.FAILED
            assert "destroyed to fence a-lost-source" in str(t.error)
            assert t.poll() is Status.FAILED  # asked again: answered, no call into the agent
            assert b.endpoint() != before
        b.write(peer, whole).wait(10)  # the same Peer, through the new agent


def test_a_fence_whose_agent_stays_referenced_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the old agent cannot be destroyed in time, the fence raises (the core then drains
    instead); the driver has switched to the new agent all the same."""
    monkeypatch.setattr(nixl_backend, "FENCE_S", 0.2)
    dst = np.zeros(4096, np.uint8)
    with xk.open_backend("nixl") as b:
        b.register(_manifest(dst, "d"))
        before, address = b.endpoint(), b.driver.address
        held = b.driver._agent  # type: ignore[attr-defined]  # as a call still running would
        started = time.monotonic()
        with pytest.raises(xk.XferError, match="still referenced") as info:
            b.fence("nixl:a-lost-source")
        assert time.monotonic() - started < 5
        assert "not fenced" in str(info.value)
        assert b.endpoint() != before and b.driver.address != address
        gone = weakref.ref(held.agent)
        del held
        assert gone() is None


def test_a_fence_that_cannot_start_a_new_agent_leaves_the_old_one_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old agent's sockets are silenced before the new agent starts; when it cannot start,
    the fence raises and lifts that: the old endpoint works as before."""
    src = np.random.default_rng(2).integers(1, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    with xk.open_backend("nixl") as a, xk.open_backend("nixl") as b:
        a.register(_manifest(src, "s"))
        m = _manifest(dst, "d")
        b.register(m)
        peer = a.connect(b.endpoint(), m)
        into = _one(src.ctypes.data, dst.ctypes.data, src.nbytes)
        a.write(peer, into).wait(10)
        before = b.endpoint()

        def refuse(self: Any) -> Any:
            raise xk.PluginError("nixl: creating agent: refused by the test")

        monkeypatch.setattr(nixl_backend.NixlDriver, "_start_agent", refuse)
        with pytest.raises(xk.XferError, match="refused by the test"):
            b.fence("nixl:a-lost-source")
        assert b.endpoint() == before
        dst[:] = 0
        a.write(peer, into).wait(10)
        np.testing.assert_array_equal(dst, src)


def test_a_fence_refuses_when_ucx_tls_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new agent would read the new UCX_TLS: with cma it would not fence. Refused, and
    nothing switched."""
    dst = np.zeros(4096, np.uint8)
    with xk.open_backend("nixl") as b:
        b.register(_manifest(dst, "d"))
        before = b.endpoint()
        monkeypatch.setenv("UCX_TLS", "tcp,cma")
        with pytest.raises(xk.XferError, match="UCX_TLS"):
            b.fence("nixl:a-lost-source")
        assert b.endpoint() == before


# -- a sender in another process, frozen mid-write ------------------------------------------

SIZE, PIECE, PER_WRITE = 256 << 20, 64 << 10, 256
"""The sender writes 256 MiB as 4096 shuffled 64 KiB pieces, 16 writes at a time."""

_SENDER = r"""
import json, sys
import numpy as np
import xferkit as xk

SIZE, PIECE, PER_WRITE = {SIZE}, {PIECE}, {PER_WRITE}
src = np.random.default_rng(7).integers(1, 256, SIZE, dtype=np.uint8)  # no zero byte
a = xk.open_backend("nixl")
a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="s", layer=0)]))
print("ready", a.capabilities.fencing, a.driver.address, flush=True)
n = SIZE // PIECE
order = np.random.default_rng(8).permutation(n).astype(np.uint64)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "quit":
        break
    manifest = xk.Manifest.decode(bytes.fromhex(cmd["manifest"]))
    peer = a.connect(bytes.fromhex(cmd["endpoint"]), manifest)
    srcs = np.uint64(src.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(PIECE)
    dsts = np.uint64(manifest.regions[0].addr) + order * np.uint64(PIECE)
    sizes = np.full(n, PIECE, np.uint64)
    try:
        for _ in range(cmd["rounds"]):  # back to back: a write is always in flight
            ts = [
                a.write(peer, xk.Descriptors(srcs[i:i + PER_WRITE], dsts[i:i + PER_WRITE],
                                             sizes[i:i + PER_WRITE]))
                for i in range(0, n, PER_WRITE)
            ]
            for t in ts:
                t.wait(60)
        a.write(peer, xk.Descriptors.empty(), notify=cmd["notify"].encode()).wait(30)
        print("done", flush=True)
    except xk.XferError as exc:
        print("failed", str(exc).replace("\n", " "), flush=True)
a.close()
"""


class _Sender:
    """The sender process: commands as JSON lines in, one line per outcome out."""

    def __init__(self) -> None:
        code = _SENDER.format(SIZE=SIZE, PIECE=PIECE, PER_WRITE=PER_WRITE)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  # its stderr, closed in close
        env = {**os.environ, "UCX_TLS": TCP, "UCX_NET_DEVICES": "lo"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, env=env, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.log.seek(0)
            tail = self.log.read()[-3000:]
        raise AssertionError(f"no answer from the sender in {timeout} s; stderr: {tail}")

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        try:
            self.send(op="quit")
            self.proc.wait(timeout=20)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def sender() -> Iterator[_Sender]:
    s = _Sender()
    try:
        yield s
    finally:
        s.close()


def test_a_sender_frozen_mid_write_lands_nothing_after_the_fence(sender: _Sender) -> None:
    """A sender process writing 256 MiB here is stopped mid-write (SIGSTOP); the fence
    returns; the memory is zeroed; the sender resumes (its kernel and UCX still hold what it
    had queued): for 2 s not a byte lands, its write fails, and a connection from the new
    endpoint writes all of it, byte-exact, with a notification naming the sender."""
    dst = np.zeros(SIZE, np.uint8)
    with xk.open_backend("nixl") as b:
        assert b.capabilities.fencing
        manifest = _manifest(dst, "d")
        b.register(manifest)
        ready = sender.line(60).split()
        assert ready[:2] == ["ready", "True"], ready  # UCX_TLS reached it too
        source = f"nixl:{ready[2]}"
        sender.send(op="write", endpoint=b.endpoint().hex(), manifest=manifest.encode().hex(),
                    rounds=1000, notify="never")  # fmt: skip
        lasts = dst[PIECE - 1 :: PIECE]  # each piece's last byte: never 0 once it landed
        deadline = time.monotonic() + 60
        while not lasts.any() and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(sender.proc.pid, signal.SIGSTOP)
        try:
            landed = int(np.count_nonzero(lasts))
            assert landed, "nothing landed from the sender in 60 s"
            before = b.endpoint()
            started = time.monotonic()
            b.fence(source)
            took = time.monotonic() - started
            dst[:] = 0
        finally:
            os.kill(sender.proc.pid, signal.SIGCONT)
        time.sleep(2.0)
        late = int(np.count_nonzero(dst))
        assert late == 0, f"{late} bytes landed after the fence (it took {took:.3f} s)"
        outcome = sender.line(30)
        assert outcome.startswith("failed"), outcome
        print(f"fence: {1000 * took:.0f} ms, {landed}/{SIZE // PIECE} pieces landed before")
        assert took < nixl_backend.FENCE_S

        assert b.endpoint() != before
        sender.send(op="write", endpoint=b.endpoint().hex(), manifest=manifest.encode().hex(),
                    rounds=1, notify="after")  # fmt: skip
        assert sender.line(60) == "done"
        n = SIZE // PIECE
        order = np.random.default_rng(8).permutation(n)
        src = np.random.default_rng(7).integers(1, 256, SIZE, dtype=np.uint8)
        np.testing.assert_array_equal(dst.reshape(n, PIECE)[order], src.reshape(n, PIECE))
        notes = drain_until(b, 1, 10)
        assert [(n.peer, n.message) for n in notes] == [(source, b"after")]
