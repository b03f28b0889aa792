"""Entry point of the example driver: announce it, import nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from xferkit.driver import BackendSpec, hookimpl


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(name="example", target="xferkit_example.driver:ExampleDriver"))
