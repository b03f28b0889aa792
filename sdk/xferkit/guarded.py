"""A driver's ``Posted`` handle behind the core's checks: a broken handle fails, never hangs.

A ``poll`` answering something other than a ``Status`` (``"done"``, ``True``)
or raising would leave a transfer misread or pending forever, and a raw
exception would escape without the peer's name. ``Guarded`` turns either into
a FAILED batch whose error names the driver and what it did; the transfer then
fails, naming the peer, and releases its batches as for any failure.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import TransferError
from .posted import Posted, Status


def guard(driver: str, op: str, posted: object) -> Guarded:
    """``posted`` as ``driver.op()`` returned it, checked to be a ``Posted`` handle."""
    if not isinstance(posted, Posted):
        raise TransferError(
            f"{driver}: {op}() returned {_shown(posted)}, not a xferkit.driver.Posted handle",
            subject=driver,
        )
    return Guarded(driver, posted)


class Guarded(Posted):
    """Forwards to the driver's handle; a broken answer turns it FAILED for good."""

    __slots__ = ("_broken", "cause", "driver", "inner")

    def __init__(self, driver: str, inner: Posted) -> None:
        self.driver, self.inner = driver, inner
        self._broken: str | None = None
        self.cause: BaseException | None = None

    def poll(self) -> Status:
        if self._broken is not None:
            return Status.FAILED
        try:
            status = self.inner.poll()
        except Exception as exc:
            return self._break(f"Posted.poll() raised {type(exc).__name__}: {exc}", exc)
        if type(status) is not Status:
            return self._break(
                f"Posted.poll() returned {_shown(status)}, not a xferkit.driver.Status"
            )
        return status

    def _break(self, what: str, cause: BaseException | None = None) -> Status:
        self._broken = f"{self.driver}: {what}"
        self.cause = cause
        return Status.FAILED

    @property
    def error(self) -> str:
        if self._broken is not None:
            return self._broken
        try:
            text = self.inner.error
        except Exception as exc:
            return f"{self.driver}: Posted.error raised {type(exc).__name__}: {exc}"
        return text if isinstance(text, str) else repr(text)

    def release(self) -> None:
        self.inner.release()  # the transfer attaches what this raises to its error

    def block(self, timeout: float) -> None:
        if self._broken is not None:
            return
        try:
            self.inner.block(timeout)
        except Exception as exc:
            self._break(f"Posted.block() raised {type(exc).__name__}: {exc}", exc)

    def on_end(self, wake: Callable[[], None]) -> bool:
        if self._broken is not None:
            wake()
            return True
        try:
            return self.inner.on_end(wake) is True
        except Exception:  # a broken hook: polled, as for a driver without one
            return False


def _shown(value: object) -> str:
    return f"{value!r} (a {type(value).__name__})" if value is not None else "None"
