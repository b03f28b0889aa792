"""The loopback's batch copies: the C helper and the pure-Python fallback agree, and fail alike."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xferkit_loopback import copy as batch

MODES = ["native", "python"]


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(batch, "NATIVE", False)
    else:
        assert batch.NATIVE, "the C helper was not built at install (gcc and Python headers)"
    return request.param


def _descs(sizes: list[int], src: np.ndarray, dst: np.ndarray, rng) -> tuple[np.ndarray, ...]:
    """Source blocks laid end to end, written to the destination in a shuffled order."""
    n = np.array(sizes, dtype=np.uint64)
    src_off = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.uint64)
    order = rng.permutation(len(sizes))
    dst_off = np.empty_like(src_off)
    dst_off[order] = np.concatenate(([0], np.cumsum(n[order])[:-1])).astype(np.uint64)
    return np.uint64(src.ctypes.data) + src_off, np.uint64(dst.ctypes.data) + dst_off, n


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=0, max_size=40), seed=st.integers(0, 99))
def test_local_and_remote_copies_match_a_plain_copy(sizes: list[int], seed: int) -> None:
    for native in (True, False):
        rng = np.random.default_rng(seed)
        total = sum(sizes)
        src = rng.integers(0, 256, total + 1, dtype=np.uint8)
        for write in ("local", "remote"):
            dst = np.zeros(total + 1, dtype=np.uint8)
            s, d, n = _descs(sizes, src, dst, rng) if sizes else (np.zeros(0, np.uint64),) * 3
            saved = batch.NATIVE
            batch.NATIVE = native and saved
            try:
                if write == "local":
                    batch.copy_local(s, d, n)
                else:  # process_vm_writev into this very process
                    assert batch.write_remote(os.getpid(), s, d, n) == (0, len(sizes))
            finally:
                batch.NATIVE = saved
            want = np.zeros_like(dst)
            for a, b, k in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                want[b - dst.ctypes.data : b - dst.ctypes.data + k] = src[
                    a - src.ctypes.data : a - src.ctypes.data + k
                ]
            np.testing.assert_array_equal(dst, want)


def test_remote_write_names_the_first_descriptor_not_written(mode: str) -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    base = np.uint64(dst.ctypes.data)
    s = np.full(3, src.ctypes.data, dtype=np.uint64)
    d = np.array([base, base + np.uint64(16), 8], dtype=np.uint64)  # the third is unmapped
    n = np.full(3, 16, dtype=np.uint64)
    err, index = batch.write_remote(os.getpid(), s, d, n)
    assert (err, index) == (errno.EFAULT, 2)
    assert (dst[:16] == src[:16]).all() and (dst[16:32] == src[:16]).all()
    assert "not mapped" in batch.explain(err, os.getpid())


def test_remote_write_to_a_gone_process_says_so(mode: str) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    buf = np.zeros(8, dtype=np.uint8)
    one = np.array([buf.ctypes.data], dtype=np.uint64)
    err, index = batch.write_remote(pid, one, one, np.array([8], dtype=np.uint64))
    assert (err, index) == (errno.ESRCH, 0)
    assert "gone" in batch.explain(err, pid)
