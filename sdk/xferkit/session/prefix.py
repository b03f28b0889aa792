"""A decode rank's prefix: the first pages of a request it holds already (a prefix cache).

``expect(..., skip={pool: n})`` says the request's first ``n`` destination slots of
``pool`` are here, so ``slots`` names only the rest; each source drops the first source
slots that would have filled them (``sends.Dst``), whatever it was asked to write, so a
prefill that writes every page (vLLM's push, sglang's sender) serves it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import ArgumentError
from .wire import MAX_SLOTS


def check_skip(skip: object, slots: Mapping[str, np.ndarray], what: str) -> dict[str, int]:
    """``skip`` as a dict of pool -> destination slots held (0 entries left out)."""
    if skip is None:
        return {}
    if not isinstance(skip, Mapping):
        raise ArgumentError(f"{what}: skip maps pool -> slots held already, not {skip!r:.80}")
    out = {}
    for pool, n in skip.items():
        if pool not in slots:
            raise ArgumentError(f"{what}: skip names pool {pool!r}, which slots does not name")
        if (type(n) is not int and not isinstance(n, np.integer)) or not 0 <= n <= MAX_SLOTS:
            raise ArgumentError(
                f"{what}: skip[{pool!r}] is a slot count 0..{MAX_SLOTS}, not {n!r:.40}"
            )
        if n:
            out[pool] = int(n)
    return out
