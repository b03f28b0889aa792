"""Which of a request's live sources write into this rank (``planner.coverage``),
remembered per set of pairs: a decode rank asks it once per request."""

from __future__ import annotations

from ..errors import PlanError
from ..manifest import Manifest
from ..planner import Coverage, coverage
from .pairs import Up

KEPT = 256
"""Sets of sources remembered (an engine pairs with a few; beyond it the cache restarts)."""


class Coverages:
    """``coverage`` of live pairs' manifests, cached by their addresses and incarnations."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._kept: dict[tuple[tuple[str, int], ...], Coverage | PlanError] = {}

    def of(self, live: list[Up]) -> Coverage | PlanError:
        key = tuple((u.address, u.welcome.incarnation if u.welcome else 0) for u in live)
        cov = self._kept.get(key)
        if cov is None:
            try:
                cov = coverage([u.manifest for u in live if u.manifest is not None], self.manifest)
            except PlanError as exc:
                cov = exc
            if len(self._kept) >= KEPT:
                self._kept.clear()
            self._kept[key] = cov
        return cov
