"""Entry point of the TCP example driver: announce it, import nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from xferkit.driver import BackendSpec, hookimpl


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(name="tcp-example", target="xferkit_tcp.driver:TcpDriver"))
