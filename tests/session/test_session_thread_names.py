"""The Session's threads, and the loopback's, carry their names at the OS, so that ``top
-H``, ``ps -L``, py-spy and ``benchmarks/bench_request_cpu.py`` tell which of them spends
an engine's CPU. Before, every one of them read ``python``."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from xferkit import open_backend
from xferkit.bench.cpu import threads_s
from xferkit.copier import CPU
from xferkit.descriptors import Descriptors
from xferkit.driver import name_thread
from xferkit.errors import ArgumentError
from xferkit.session import Session
from xferkit.session.packer import Packer
from xferkit.testing import Reference, gdn_hybrid


def _names_soon(wanted: set[str], within_s: float = 5.0) -> set[str]:
    """This process's thread names once ``wanted`` are among them (threads name themselves
    as they start), or as they are when ``within_s`` ran out."""
    limit = time.monotonic() + within_s
    while True:
        names = set(threads_s(os.getpid()))
        if wanted <= names or time.monotonic() > limit:
            return names
        time.sleep(0.01)


def test_a_sessions_threads_and_the_loopbacks_are_named_at_the_os() -> None:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots={"kv": 4, "state": 2},
                    dst_slots={"kv": 4, "state": 2})  # fmt: skip
    session = Session(open_backend("loopback"), ref.srcs[0].manifest)
    try:
        wanted = {"xk-control", "xk-data", "xk-loopback-rx"}
        assert wanted <= _names_soon(wanted)
    finally:
        session.close()


def test_the_pack_worker_is_named_once_it_starts() -> None:
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    packer = Packer(CPU, lambda event: None)
    one = np.ones(1, dtype=np.uint64)
    packer.run(
        "r1",
        Descriptors(
            one * np.uint64(src.ctypes.data), one * np.uint64(dst.ctypes.data), one * np.uint64(64)
        ),
    ).result()
    try:
        assert "xk-pack" in _names_soon({"xk-pack"})
        assert (dst == src).all()
    finally:
        packer.stop()


def _os_name_after(name: str) -> list[str]:
    """What the OS calls a new thread that named itself ``name`` (nothing if it raised)."""
    seen: list[str] = []

    def body() -> None:
        name_thread(name)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen


def test_a_name_is_shortened_to_what_the_os_keeps() -> None:
    """``xferkit-`` becomes ``xk-`` and the rest is cut at 15 bytes (Linux keeps 16 with the
    terminating zero): the name a driver's ``BatchWorker`` thread gets from its Python name."""
    assert _os_name_after("xferkit-loopback-0123456789") == ["xk-loopback-012"]


def test_a_name_that_is_not_a_str_is_refused_naming_it() -> None:
    with pytest.raises(ArgumentError, match="name_thread"):
        name_thread(b"xk-bytes")  # type: ignore[arg-type]


def test_a_name_that_cannot_encode_still_names_the_thread() -> None:
    """A lone surrogate raised UnicodeEncodeError from the thread's first line."""
    assert _os_name_after("xk-\udc80-odd") == ["xk-?-odd"]
