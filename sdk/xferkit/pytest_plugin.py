"""xferkit's pytest plugin (the ``pytest11`` entry point): the kit's assertions show values.

pytest rewrites ``assert`` only in test modules and in modules registered
before they are imported; the conformance kit is an installed package, so
without this a driver author's failing kit test reads as a bare
``AssertionError``. Loaded at pytest start-up, before any test imports the kit.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("xferkit.testing")
