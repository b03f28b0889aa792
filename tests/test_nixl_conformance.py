"""The NIXL driver (a real agent, UCX on host memory) passes the conformance kit.

In this process and against a peer process; once with ``initialize_xfer`` per
post (the default) and once with the prepared-list fast path.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

try:
    import nixl._api  # noqa: F401
except ImportError:
    try:
        import nixl_cu12._api  # noqa: F401
    except ImportError as exc:
        pytest.skip(
            f"nixl is not installed ({exc}); pip install --no-deps nixl-cu12 nixl",
            allow_module_level=True,
        )

from xferkit.testing.conformance import BackendConformance


class TestNixl(BackendConformance):
    backend = "nixl"


class TestNixlPrepared(BackendConformance):
    backend = "nixl"
    options: ClassVar[dict[str, Any]] = {"post": "prepared"}
