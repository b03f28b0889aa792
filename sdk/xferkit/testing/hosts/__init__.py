"""Many hosts in one box, for tests that need the network between ranks to be real.

``Hosts(n)`` makes ``n`` network namespaces on one switch (a bridge in a namespace of
its own), each host with its own address; ``host.start(argv)`` runs a rank inside a
host; ``cut``/``mend``, ``limit`` (tc tbf), ``counters`` act on its link, and
``Process.freeze``/``resume``/``kill``/``restart`` on its process. Everything is removed on
``close``, at interpreter exit, or, after a run killed outright, by the next run's sweep.
Needs root and iproute2 (``ip``, ``tc``).
"""

from .box import IFACE, Counters, Host, Hosts
from .ip import PREFIX, HostError, sweep
from .process import Process

__all__ = ["IFACE", "PREFIX", "Counters", "Host", "HostError", "Hosts", "Process", "sweep"]
