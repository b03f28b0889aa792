"""The pack worker: staged rounds gathered off the control thread, waited on as futures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from xferkit.copier import CPU
from xferkit.descriptors import Descriptors
from xferkit.session.packer import Packer


def _copy(src: np.ndarray, dst: np.ndarray, pieces: list[tuple[int, int, int]]) -> Descriptors:
    a, b, n = (np.array(c, dtype=np.uint64) for c in zip(*pieces, strict=True))
    return Descriptors(a + np.uint64(src.ctypes.data), b + np.uint64(dst.ctypes.data), n)


class _Gated:
    """A copier that copies once the test opens its gate, or raises when told to."""

    device = "cpu"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        assert self.gate.wait(10)
        if self.fail:
            raise OSError("copier broke")
        CPU.copy(src, dst, nbytes)


def test_a_pack_is_done_once_its_bytes_are_copied_and_wakes_the_control_thread_after() -> None:
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    copier, woken = _Gated(), list[object]()
    packer = Packer(copier, woken.append)
    first = packer.run("r1", _copy(src, dst, [(0, 0, 64)]))
    second = packer.run("r2", _copy(src, dst, [(64, 128, 32), (200, 160, 8)]))
    assert not first.done() and not second.done() and not woken and not dst.any()
    copier.gate.set()
    began, ended = second.result()  # waits for both: one worker, in order
    assert first.done() and second.done() and began <= ended
    assert (dst[:64] == src[:64]).all() and (dst[128:160] == src[64:96]).all()
    assert (dst[160:168] == src[200:208]).all() and not dst[64:128].any()
    packer.stop()
    assert woken == [("pump", "r1"), ("pump", "r2")]


def test_a_failed_copy_raises_from_its_result_and_still_wakes_the_control_thread() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    copier, woken = _Gated(), list[object]()
    copier.fail = True
    copier.gate.set()
    packer = Packer(copier, woken.append)
    pack = packer.run("r", _copy(buf, buf, [(0, 32, 8)]))
    with pytest.raises(OSError, match="copier broke"):
        pack.result()
    assert pack.done()
    packer.stop()
    assert woken == [("pump", "r")]


def test_stop_runs_what_is_queued_and_later_packs_are_refused() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    copier = _Gated()
    packer = Packer(copier, lambda _: None)
    packs = [packer.run(f"r{i}", _copy(src, dst, [(8 * i, 8 * i, 8)])) for i in range(4)]
    copier.gate.set()
    packer.stop()  # returns once every queued pack copied
    assert all(p.done() for p in packs) and (dst[:32] == src[:32]).all()
    with pytest.raises(RuntimeError, match="stopped"):
        packer.run("late", _copy(src, dst, [(0, 0, 8)]))


def test_a_copier_raising_past_exception_leaves_the_worker_serving_later_packs() -> None:
    """A BaseException from the copier (what a ``concurrent.futures`` worker also survives)
    is raised from that pack's ``result``; the next pack still runs, so nothing waits on a
    thread that died."""

    class Interrupting:
        device = "cpu"
        calls = 0

        def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
            Interrupting.calls += 1
            if Interrupting.calls == 1:
                raise KeyboardInterrupt
            CPU.copy(src, dst, nbytes)

    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    packer = Packer(Interrupting(), lambda _: None)
    first = packer.run("r1", _copy(src, dst, [(0, 0, 8)]))
    second = packer.run("r2", _copy(src, dst, [(8, 8, 8)]))
    deadline = time.monotonic() + 10
    while not second.done() and time.monotonic() < deadline:  # bounded: a dead worker fails
        time.sleep(0.001)
    assert second.done() and first.done()
    assert second.result()[0] > 0 and (dst[8:] == src[8:]).all() and not dst[:8].any()
    with pytest.raises(KeyboardInterrupt):
        first.result()
    packer.stop()
