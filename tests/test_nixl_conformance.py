"""The NIXL driver (a real agent, UCX on host memory) passes the conformance kit.

In this process and against a peer process; once with ``initialize_xfer`` per
post (the default) and once with the prepared-list fast path.
"""

from __future__ import annotations

from typing import Any, ClassVar

from drivers import require_nixl

from xferkit.testing.conformance import BackendConformance

require_nixl()


class TestNixl(BackendConformance):
    backend = "nixl"


class TestNixlPrepared(BackendConformance):
    backend = "nixl"
    options: ClassVar[dict[str, Any]] = {"post": "prepared"}
