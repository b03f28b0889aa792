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
    if late:
        notes.append(
            "UCX was already loaded in this process before xferkit-nixl could set its "
            "environment; the settings above apply only to processes that start fresh"
        )
        log.warning("%s", notes[-1])
    if environ is None and devices is None:
        _applied = notes
    return notes
