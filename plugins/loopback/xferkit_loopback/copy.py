"""Batch copies: the C helper when it was built, plain Python otherwise (same results)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

import numpy as np

try:
    from ._batchcopy import copy as _native_copy
    from ._batchcopy import writev as _native_writev

    NATIVE = True
except ImportError:  # built without a compiler
    NATIVE = False

_IOV_MAX = 1024


def copy_local(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """memcpy each (src, dst, nbytes) within this process."""
    if NATIVE:
        _native_copy(*(np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, nbytes)))
        return
    for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


_libc = ctypes.CDLL(None, use_errno=True)
_pvm_writev = _libc.process_vm_writev
_pvm_writev.restype = ctypes.c_ssize_t
_pvm_writev.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def write_remote(pid: int, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[int, int]:
    """process_vm_writev into ``pid``.

    Returns (errno, index of the first descriptor not fully written); (0, n) on success.
    """
    if NATIVE:
        return _native_writev(
            pid, *(np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, nbytes))
        )
    done = 0
    while done < src.size:
        k = min(_IOV_MAX, src.size - done)
        local = np.stack([src[done : done + k], nbytes[done : done + k]], axis=1).astype(np.uint64)
        remote = np.stack([dst[done : done + k], nbytes[done : done + k]], axis=1).astype(np.uint64)
        got = _pvm_writev(pid, local.ctypes.data, k, remote.ctypes.data, k, 0)
        if got < 0:
            return ctypes.get_errno(), done
        want = int(nbytes[done : done + k].sum())
        if got != want:
            full = int(np.searchsorted(np.cumsum(nbytes[done : done + k]), got, side="right"))
            return errno.EFAULT, done + full
        done += k
    return 0, done


_pvm_readv = _libc.process_vm_readv
_pvm_readv.restype = ctypes.c_ssize_t
_pvm_readv.argtypes = _pvm_writev.argtypes


class RemoteWord:
    """One uint64 of another process, read again and again (its iovecs are built once).

    Not thread-safe: one reader at a time.
    """

    __slots__ = ("_local", "_pid", "_remote", "_value")

    def __init__(self, pid: int, addr: int) -> None:
        self._pid = pid
        self._value = ctypes.c_uint64()
        local = (ctypes.c_uint64 * 2)(ctypes.addressof(self._value), 8)
        remote = (ctypes.c_uint64 * 2)(addr, 8)
        self._local = (local, ctypes.addressof(local))
        self._remote = (remote, ctypes.addressof(remote))

    def read(self) -> tuple[int, int]:
        """(errno, value), read with process_vm_readv."""
        got = _pvm_readv(self._pid, self._local[1], 1, self._remote[1], 1, 0)
        if got != 8:
            return (ctypes.get_errno() or errno.EFAULT), 0
        return 0, self._value.value


def start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process ever."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22 of the whole line


def allow_writers() -> None:
    """Let other processes of this user write here (Yama ptrace_scope 1 refuses them otherwise)."""
    pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, 2**64 - 1
    with contextlib.suppress(AttributeError, OSError):
        _libc.prctl(pr_set_ptracer, ctypes.c_ulong(pr_set_ptracer_any), 0, 0, 0)


def explain(err: int, pid: int) -> str:
    """What a process_vm_writev errno means for the user, and what to change."""
    text = f"process_vm_writev into pid {pid} failed: {os.strerror(err)} (errno {err})"
    if err == errno.EPERM:
        return text + (
            "; the kernel refuses cross-process writes here: run both processes as the same "
            "user, and lower kernel.yama.ptrace_scope to 0 or 1 (sysctl), or grant CAP_SYS_PTRACE "
            "(containers: --cap-add SYS_PTRACE or a seccomp profile allowing process_vm_writev)"
        )
    if err == errno.ENOSYS:
        return text + "; the kernel or its seccomp policy does not provide process_vm_writev"
    if err == errno.ESRCH:
        return text + "; the peer process is gone"
    if err == errno.EFAULT:
        return text + "; an address is not mapped in the peer (its memory was freed)"
    return text
