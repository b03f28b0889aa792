"""UCX settings applied before the first NIXL agent of a process, unless the user set them.

UCX reads its environment once, when its first context is created (here: the
first NIXL agent with a UCX backend), so these defaults are applied just
before that and never override a value the user set.

``UCX_MODULES``: with the nixl-cu12 wheel, a process that created a UCX
backend segfaults at interpreter exit (exit code 139) on machines that also
have rdma-core's providers installed (``ibverbs-providers``, pulled in by
apt's ``libibverbs1``, which the Mooncake driver needs). UCX's EFA module,
bundled in the wheel, links the system ``libefa``, which loads the system
``libibverbs`` and ``libnl-route`` next to the copies bundled in the wheel;
at exit the bundled ``libnl-route`` crashes in ``rtnl_tc_unregister``
(``_dl_fini``). A crash at exit turns a passing pytest run into exit code 139.
Not loading UCX's EFA module avoids it:

* no RDMA device at all (``/sys/class/infiniband`` empty or missing):
  ``UCX_MODULES=^ib``: none of UCX's InfiniBand modules has anything to drive;
* RDMA devices, none of them EFA: ``UCX_MODULES=^efa``: only the EFA module
  is left out, the verbs transports (mlx5, ...) stay;
* an EFA device: nothing is set (leaving EFA out would lose it); a warning
  says the process may end with exit code 139.

``UCX_LOG_FILE``: UCX writes its log lines to stdout by default, which
corrupts any protocol that uses stdout (the conformance kit's peer process,
for one); the default here is ``stderr``.

``UCX_USE_MT_MUTEX=y``: UCX guards each worker with a spinlock by default. NIXL's progress
thread and the thread that posts both take it, and on host memory the post copies inside
the lock (``process_vm_writev``, milliseconds for a staged round), so the progress thread
spun on a core for as long as each copy ran: 7-9% of a 2-core machine under an engine's
load, and a process used 1.9-2.0 CPU seconds a second of one long write. A mutex puts the
waiter to sleep instead (docs/nixl.md, "The progress thread spins on UCX's lock").

``UCX_TLS`` is not set here, only read (``fencing``): which transports a context
may use is read again at every context's creation (every agent), unlike
``UCX_MODULES``, which decides once per process which modules load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

from xferkit.driver import rdma_devices

log = logging.getLogger("xferkit.nixl")


def _is_efa(name: str, driver: str) -> bool:
    return driver == "efa" or name.startswith(("efa", "rdmap"))


def ucx_modules_default(devices: Mapping[str, str]) -> tuple[str | None, str]:
    """The ``UCX_MODULES`` value to set for these RDMA devices (None: set nothing), and why."""
    if not devices:
        return "^ib", "no RDMA device under /sys/class/infiniband, so UCX's ib modules are unused"
    efa = sorted(name for name, driver in devices.items() if _is_efa(name, driver))
    if not efa:
        return "^efa", f"RDMA devices {sorted(devices)} include no EFA device"
    return None, f"EFA device(s) {efa} present; leaving UCX's EFA module out would lose them"


def _ucx_loaded() -> bool:
    """Whether UCX is already in this process (then its environment was read already)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libucs" in line for line in maps)
    except OSError:
        return False


_applied: list[str] | None = None


def apply_defaults(
    environ: MutableMapping[str, str] | None = None, devices: Mapping[str, str] | None = None
) -> list[str]:
    """Set the defaults once per process; return (and log) what was decided."""
    global _applied
    if _applied is not None and environ is None and devices is None:
        return _applied
    env = os.environ if environ is None else environ
    devs = rdma_devices() if devices is None else devices
    notes: list[str] = []
    late = environ is None and _ucx_loaded()
    if "UCX_MODULES" in env:
        notes.append(f"UCX_MODULES={env['UCX_MODULES']!r} was set by the user; left as is")
    else:
        value, why = ucx_modules_default(devs)
        if value is None:
            notes.append(
                f"UCX_MODULES left unset: {why}; this process may segfault at exit (code 139) "
                "because of the two libnl-route copies (see docs/nixl.md)"
            )
            log.warning("%s", notes[-1])
        else:
            env["UCX_MODULES"] = value
            notes.append(
                f"UCX_MODULES={value} set ({why}): avoids the segfault at process exit "
                "caused by UCX's EFA module loading a second libnl-route; set UCX_MODULES "
                "yourself to override"
            )
            log.info("%s", notes[-1])
    if "UCX_LOG_FILE" not in env:
        env["UCX_LOG_FILE"] = "stderr"
        notes.append("UCX_LOG_FILE=stderr set (UCX logs to stdout by default)")
        log.info("%s", notes[-1])
    if "UCX_USE_MT_MUTEX" not in env:
        env["UCX_USE_MT_MUTEX"] = "y"
        notes.append(
            "UCX_USE_MT_MUTEX=y set: a thread waiting for a UCX worker's lock sleeps rather "
            "than spins while another copies under it"
        )
        log.info("%s", notes[-1])
    if late:
        notes.append(
            "UCX was already loaded in this process before xferkit-nixl could set its "
            "environment; the settings above apply only to processes that start fresh"
        )
        log.warning("%s", notes[-1])
    if environ is None and devices is None:
        _applied = notes
    return notes


ONE_SIDED = frozenset({"cma", "knem", "xpmem"})
"""UCX's same-host transports in which the sender writes the receiver's memory itself
(``process_vm_writev``, a kernel module, a mapping of it): nothing the receiver does to its
agent stops a write already set up, so no fence holds while one is in force."""

RECEIVER_APPLIED = frozenset({"tcp", "self", "posix", "sysv", "cuda_copy", "rocm_copy"})
"""Transports through which a peer's write lands only when the receiving agent's UCX worker
applies it (``tcp``; the shared-memory queues ``posix`` and ``sysv``, which carry messages,
not remote memory), or that never reach another agent (``self``, and the local GPU copies
``cuda_copy``, ``rocm_copy``): destroying the agent ends every such write."""

_ALIASES = {"sm": ONE_SIDED | {"posix", "sysv"}, "shm": ONE_SIDED | {"posix", "sysv"}}
_ALIASES["mm"] = frozenset({"posix", "sysv", "xpmem"})


def fencing(tls: str | None, devices: Mapping[str, str], gpus: bool) -> tuple[bool, str]:
    """Whether destroying an agent cuts every peer's writes into its memory with ``UCX_TLS``
    set to ``tls`` (None: unset) on a host with these RDMA ``devices`` (and NVIDIA ``gpus``
    or not), and why.

    Yes when the transports in force are all ``RECEIVER_APPLIED``: a list naming only those,
    or a deny list (``^...``) leaving out every ``ONE_SIDED`` one on a host where nothing
    else is left (no RDMA device, no GPU: tcp, posix, sysv, self, as measured). RDMA
    transports probably fence too (the agent's queue pairs and memory keys go with it), but
    no RDMA device has been here to show it.
    """
    if tls is None or not tls.strip():
        return False, "UCX_TLS is unset, so UCX may use cma, with which the sender writes itself"
    names = [n.strip() for n in tls.strip().removeprefix("^").split(",") if n.strip()]
    if not tls.strip().startswith("^"):
        other = sorted(set(names) - RECEIVER_APPLIED)
        if other or not names:
            return False, (
                f"UCX_TLS={tls!r} names {other or 'nothing'}, not only transports that need "
                f"the receiving agent to apply a write ({', '.join(sorted(RECEIVER_APPLIED))})"
            )
        return True, f"UCX_TLS={tls!r}: every write needs the receiving agent to land"
    denied = set(names).union(*(_ALIASES.get(n, ()) for n in names))
    if missing := sorted(ONE_SIDED - denied):
        return False, f"UCX_TLS={tls!r} leaves {missing} in force, with which the sender writes"
    if devices or gpus:
        what = f"RDMA devices {sorted(devices)}" if devices else "NVIDIA GPUs (cuda_ipc)"
        return False, (
            f"UCX_TLS={tls!r} leaves every other transport in force, and with {what} here "
            "that includes some no test has shown a fence for"
        )
    return True, f"UCX_TLS={tls!r} leaves only tcp, posix, sysv and self on this host"
