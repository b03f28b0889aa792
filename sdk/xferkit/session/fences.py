"""The fences a decode rank asked its driver for: which lost source each is for, in the
order the driver answers them, and the failed ones to ask again."""

from __future__ import annotations

from collections.abc import Iterator

REFENCE_S = 1.0
"""How long after a fence failed (a NIC or link down) it is asked for again."""


class Fences:
    """Fences asked for and not answered yet (``Fence`` actions), and failed ones due again."""

    def __init__(self) -> None:
        self._asked: dict[str, list[str]] = {}  # driver -> the lost addresses, answered in order
        self._again: list[tuple[float, str, str]] = []  # (when, driver, address): failed

    def ask(self, driver: str, address: str) -> None:
        self._asked.setdefault(driver, []).append(address)

    def answered(self, driver: str, error: str, now: float) -> str | None:
        """The lost address the driver's answer for ``driver`` is for (None: none was asked);
        a failed one (``error``) is due again in ``REFENCE_S``."""
        waiting = self._asked.get(driver)
        if not waiting:
            return None
        address = waiting.pop(0)
        if not waiting:
            del self._asked[driver]
        if error:
            self._again.append((now + REFENCE_S, driver, address))
        return address

    def pending(self) -> Iterator[str]:
        """The lost addresses still waiting for an answer (a fence that cuts every peer at
        once settles them all)."""
        for addresses in self._asked.values():
            yield from addresses

    def due(self, now: float) -> list[tuple[str, str]]:
        """(driver, address) of the failed fences to ask again now."""
        due = [(d, a) for t, d, a in self._again if t <= now]
        self._again = [f for f in self._again if f[0] > now]
        return due

    def next_deadline(self) -> float:
        return min((f[0] for f in self._again), default=float("inf"))
