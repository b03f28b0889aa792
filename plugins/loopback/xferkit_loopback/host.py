"""Which host a process is on, as far as the loopback can reach across it.

The loopback writes with process_vm_writev (the peer named by its pid, so both
must share a pid namespace) and notifies on an abstract unix socket (scoped to a
network namespace), on one running kernel (one boot). A peer differing in any of
these is on another host for the loopback: its bytes could land but its
notification could not (before: the whole payload written, then "Connection
refused"). The mount namespace is left out on purpose: ``ip netns exec`` gives each
process a mount namespace of its own, and neither a pid nor an abstract socket
depends on it.
"""

from __future__ import annotations

import os

import msgspec


class HostId(msgspec.Struct, frozen=True):
    """The kernel boot and the namespaces a loopback peer must share."""

    boot: str  # /proc/sys/kernel/random/boot_id
    pid_ns: int  # inode of /proc/self/ns/pid: process_vm_writev names the peer by pid
    net_ns: int  # inode of /proc/self/ns/net: the notification socket lives there

    def differs(self, other: HostId) -> list[str]:
        """What ``other`` does not share with this host, as ``what: here vs there``."""
        return [
            f"{name} {mine} here, {theirs} there"
            for name, mine, theirs in (
                ("boot id", self.boot, other.boot),
                ("pid namespace", self.pid_ns, other.pid_ns),
                ("network namespace", self.net_ns, other.net_ns),
            )
            if mine != theirs
        ]


def this_host() -> HostId:
    """This process's host, read now (a process may enter other namespaces later)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return HostId(boot, os.stat("/proc/self/ns/pid").st_ino, os.stat("/proc/self/ns/net").st_ino)
