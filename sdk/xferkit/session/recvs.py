"""What a decode rank tracks per request: ``Recv``, its sources once resolved, what each
of them owes it (``Source``), and how it is failing."""

from __future__ import annotations

import numpy as np

from .states import RequestError, Routes
from .timeline import Timeline
from .unpacking import Source


class Recv:
    """A decode request as the core tracks it."""

    def __init__(
        self, handle: object, rid: str, gen: int, spec: tuple[str, ...], slots: dict,
        registration: int, deadline: float, skip: dict[str, int],
    ) -> None:  # fmt: skip
        self.handle = handle
        self.rid = rid
        self.gen = gen
        self.spec = spec  # as given to expect: session or group addresses
        self.sources: tuple[str, ...] = ()  # every source rank's session address, once resolved
        self.slots: dict[str, np.ndarray] = slots
        self.skip = skip  # destination slots of a pool held already (a prefix cache)
        self.registration = registration
        self.deadline = deadline
        self.needed: dict[str, Source] = {}
        self.requested: set[str] = set()
        self.started = False
        self.transferring = False  # its handle was told so (once; DONE implies it)
        self.error: RequestError | None = None
        self.acks: set[str] = set()
        self.barriers: set[str] = set()  # sources whose writes' end is still on the data path
        self.ended: set[str] = set()  # sources whose end landed on it (``wire.Ended``)
        self.drain_until = 0.0
        self.waiting_since = 0.0  # when it began to wait for staging
        self.staging_wait_s = 0.0
        self.timeline = Timeline()

    def waits_on(self, address: str) -> bool:
        """Whether FAILED waits for ``address`` to confirm its writes stopped."""
        return address in self.acks or address in self.barriers

    @property
    def routes(self) -> Routes:
        return Routes(staging_wait_s=self.staging_wait_s, peers=self.sources)
