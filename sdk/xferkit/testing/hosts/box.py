"""Many hosts in one box: network namespaces on one switch, each host its own address.

Each host is a network namespace holding ``eth0`` (its address, ``10.77.0.<i+1>/24`` by
default) and ``lo``; the other end of its veth pair is a port of a bridge in a switch
namespace. Nothing is added to the namespace the tests run in, so no traffic leaves the
addresses made here. Faults act on the link or the process, as they would between
machines: ``cut`` takes the switch port down (the host's packets go nowhere, nothing
tells it), ``limit`` shapes both directions with ``tc tbf``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from ...closing import Closing
from . import ip
from .ip import PREFIX, HostError, sh
from .process import Process

_COUNT = itertools.count()
_OPEN: weakref.WeakSet[Hosts] = weakref.WeakSet()

IFACE = "eth0"
"""The host's side of its link, in every host namespace."""


class Counters(NamedTuple):
    """An interface's byte and packet counters (the kernel's, as ``ip -s link`` reads them)."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int


class Host:
    """One host: a network namespace with one address on the box's switch."""

    def __init__(self, box: Hosts, index: int, address: str) -> None:
        self.box = box
        self.index = index
        self.name = f"{box.name}-h{index}"  # the namespace
        self.address = address
        self.port = f"p{index}"  # the switch's end of this host's link
        self._processes: list[Process] = []

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def prefix(self) -> list[str]:
        """What runs a command in this host: ``[*prefix(), *argv]``."""
        return ["ip", "netns", "exec", self.name]

    def sh(self, *argv: str, check: bool = True) -> str:
        """Run a command in this host and wait; its stdout."""
        return sh([*self.prefix(), *argv], check=check)

    def start(self, argv: Sequence[str], **popen: Any) -> Process:
        """Start ``argv`` in this host (``subprocess.Popen`` keywords pass through); it is
        killed when the box closes."""
        proc = Process(self.name, self.prefix(), argv, **popen)
        self._processes.append(proc)
        return proc

    def python(self, *args: str, **popen: Any) -> Process:
        """This interpreter, with ``args``, in this host."""
        return self.start([sys.executable, *args], **popen)

    # -- the link --------------------------------------------------------

    def counters(self) -> Counters:
        """The byte counters of this host's ``eth0`` (what crossed its link, both ways)."""
        out = sh(["ip", "-n", self.name, "-s", "-j", "link", "show", "dev", IFACE])
        stats = json.loads(out)[0]["stats64"]
        rx, tx = stats["rx"], stats["tx"]
        return Counters(rx["bytes"], tx["bytes"], rx["packets"], tx["packets"])

    def cut(self) -> None:
        """Unplug the cable at the switch: packets to and from this host are lost, silently."""
        sh(["ip", "-n", self.box.switch, "link", "set", self.port, "down"])

    def mend(self) -> None:
        """Plug it back in (after ``cut``)."""
        sh(["ip", "-n", self.box.switch, "link", "set", self.port, "up"])

    def limit(self, rate: str, burst: str = "32kb", latency: str = "200ms") -> None:
        """Shape this host's link to ``rate`` (tc's units: ``"8mbit"``), both directions."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        for ns, dev in ((self.name, IFACE), (self.box.switch, self.port)):
            sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf])

    def unlimit(self) -> None:
        """Remove ``limit``'s shaping."""
        for ns, dev in ((self.name, IFACE), (self.box.switch, self.port)):
            sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def qdisc(self) -> str:
        """``tc qdisc show`` of this host's ``eth0``."""
        return sh(["tc", "-n", self.name, "qdisc", "show", "dev", IFACE])

    def _close(self) -> None:
        for proc in self._processes:
            proc.close()
        self._processes.clear()


class Hosts(Closing):
    """``n`` hosts on one switch, made at construction, removed by ``close`` (or at exit).

    ``subnet`` is the first three octets of the hosts' addresses; host ``i`` is
    ``<subnet>.<i+1>``. Leftovers of a killed run are swept first.
    """

    def __init__(self, n: int = 2, subnet: str = "10.77.0") -> None:
        if not 1 <= n <= 250:
            raise HostError(f"a box holds 1 to 250 hosts, not {n}", subject=n)
        if os.geteuid() != 0:
            raise HostError("network namespaces need root (CAP_NET_ADMIN)", subject=os.geteuid())
        self.swept = ip.sweep()
        self.name = f"{PREFIX}{os.getpid()}-{next(_COUNT)}"
        self.switch = f"{self.name}-sw"
        self.hosts = [Host(self, i, f"{subnet}.{i + 1}") for i in range(n)]
        self._closed = False
        _OPEN.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def namespaces(self) -> list[str]:
        """The namespaces this box is made of: every host's, then the switch's."""
        return [h.name for h in self.hosts] + [self.switch]

    def _build(self) -> None:
        sw = self.switch
        sh(["ip", "netns", "add", sw])
        sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            sh(["ip", "netns", "add", h.name])
            sh(["ip", "-n", h.name, "link", "set", "lo", "up"])
            peer = ["peer", "name", IFACE, "netns", h.name]
            sh(["ip", "-n", sw, "link", "add", h.port, "type", "veth", *peer])
            sh(["ip", "-n", sw, "link", "set", h.port, "master", "br0", "up"])
            sh(["ip", "-n", h.name, "addr", "add", f"{h.address}/24", "dev", IFACE])
            sh(["ip", "-n", h.name, "link", "set", IFACE, "up"])

    def close(self) -> None:
        """Kill every process started in a host, then delete every namespace (and so every
        link). Idempotent; also run at interpreter exit for a box left open."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            h._close()
        made = set(ip.namespaces())
        for name in self.namespaces():
            if name in made:
                ip.remove(name)


@atexit.register
def _close_all() -> None:
    for box in list(_OPEN):
        box.close()
