"""A driver's handle on one posted batch, and the three states every handle reports.

Its own module so that the driver contract (``driver``) and the threading
helper (``worker``) share it without importing each other.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable


class Status(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Posted(ABC):
    """A driver's handle on one posted batch (or notification).

    ``poll`` and ``block`` may run in several threads at once, and concurrently
    with ``release`` (an engine thread waits while ``close`` aborts): guard
    shared state. After ``release``, ``poll`` keeps answering without touching
    freed engine handles, and reports PENDING only while the engine may still
    read or write the batch's memory.
    """

    __slots__ = ()  # so that a subclass's ``__slots__`` means something

    @abstractmethod
    def poll(self) -> Status:
        """Progress check; must never block."""

    @property
    @abstractmethod
    def error(self) -> str:
        """The driver's own text for a FAILED batch."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free driver resources; called once, after completion or to abort a pending batch."""

    def block(self, timeout: float) -> None:
        """Sleep until the batch may have progressed, at most ``timeout`` seconds.

        Drivers that can block on completion override this; the default naps.
        """
        time.sleep(min(timeout, 5e-5))

    def on_end(self, wake: Callable[[], None]) -> bool:
        """Call ``wake`` (from any thread, perhaps more than once) when this batch ends, or at
        once if it has; False when the driver cannot, and its caller must poll.

        Drivers whose own thread learns of the end override this (``QueuedBatch`` does): the
        Session then polls the write on its control thread when it ends instead of polling
        every write every millisecond on its worker, which costs the GIL the driver's threads
        need; such a driver's ``poll`` must read a status, and its posts hand over to its own
        thread (slow ones send its calls back to the worker).
        """
        return False


class Done(Posted):
    """A batch that completed when it was posted (a synchronous engine call)."""

    __slots__ = ()

    def poll(self) -> Status:
        return Status.DONE

    @property
    def error(self) -> str:
        return ""
