"""Guards for test modules that need a real driver (in CI a skip fails, see conftest)."""

from __future__ import annotations

import importlib

import pytest


def require_nixl() -> None:
    """Skip the calling module unless NIXL imports (as ``nixl`` or ``nixl_cu12``)."""
    error: ImportError | None = None
    for module in ("nixl._api", "nixl_cu12._api"):
        try:
            importlib.import_module(module)
            return
        except ImportError as exc:
            error = error or exc
    pytest.skip(
        f"nixl is not installed ({error}); pip install --no-deps nixl-cu12 nixl",
        allow_module_level=True,
    )
