"""A failing request's writes still on the wire (issue 17): FAILED means no byte can land.

A DMA already posted cannot always be called back: the NIC finishes it. Here
the prefill's driver is ``InFlight``, a MockDriver whose posts, once held,
ignore the core's release and land (data, then notification) only when the
test says; both Sessions run in this process over real ZMQ (MockDriver copies
within one process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import pytest

from xferkit import Backend, Descriptors, Manifest, XferError
from xferkit.driver import Posted, Status
from xferkit.session import Receive, RequestError, Session, State
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver
from xferkit.testing.reference import execute

SLOTS = {"kv": 8, "state": 4}
DEAD_AFTER_S = 0.5


class OnTheWire(Posted):
    """A batch the NIC already took: ``release`` cannot stop it; ``land`` ends it DONE."""

    def __init__(self, descs: Descriptors | None, land: Callable[[], None]) -> None:
        self._status = Status.PENDING
        self._descs = descs
        self._land = land
        self.released = 0

    def poll(self) -> Status:
        return self._status

    @property
    def error(self) -> str:
        return ""

    def release(self) -> None:
        self.released += 1  # too late to call it back

    def land(self) -> None:
        if self._descs is not None:
            execute(self._descs)
        self._land()
        self._status = Status.DONE


class InFlight(MockDriver):
    """A MockDriver whose posts, while ``hold`` is set, stay on the wire until ``land_all``."""

    def __init__(self, target: MockDriver) -> None:
        super().__init__()
        self.target = target
        self.hold = False
        self.held: list[OnTheWire] = []

    def _deliver(self, op: str, link: Any, descs: Descriptors | None, note: bytes | None) -> Posted:
        if not (self.hold and op == "post"):
            return super()._deliver(op, link, descs, note)
        self._call(op, descs=descs, message=note, link=link)

        def notify() -> None:
            if note is not None:
                self.target.inbox.append((self.address, note))

        posted = OnTheWire(descs, notify)
        self.held.append(posted)
        self.handles.append(posted)
        return posted

    def land_all(self) -> None:
        for posted in self.held:
            posted.land()


@contextmanager
def pair(dec_timeout: float) -> Iterator[tuple[Reference, InFlight, Session, Session]]:
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    dst_driver = MockDriver()
    src_driver = InFlight(dst_driver)

    def session(driver: MockDriver, manifest: Manifest, timeout: float = 60.0) -> Session:
        return Session(
            Backend(driver),
            manifest,
            heartbeat_s=0.1,
            dead_after_s=DEAD_AFTER_S,
            request_timeout_s=timeout,
            staging="never",
        )

    dec = session(dst_driver, ref.dsts[0].manifest, dec_timeout)
    pre = session(src_driver, ref.srcs[0].manifest)
    try:
        yield ref, src_driver, pre, dec
    finally:
        src_driver.land_all()  # nothing left on the wire when the memory goes
        pre.close()
        dec.close()


def _until(check: Callable[[], bool], seconds: float) -> bool:
    limit = time.monotonic() + seconds
    while not check() and time.monotonic() < limit:
        time.sleep(0.01)
    return check()


def _abort(recv: Receive) -> None:
    with suppress(XferError):  # the state says how it ended
        recv.abort(10)


@pytest.mark.parametrize("cause", ["abort", "timeout"])
def test_no_byte_lands_after_the_receive_reports_failed(cause: str) -> None:
    """Defect: after a decode rank's abort (or its request timing out) it stopped waiting for
    the prefill's AbortAck after dead_after_s and reported FAILED while the prefill was still
    draining a write it could not call back (up to 10 s): the engine reused the slots and the
    write landed in them. Fixed: ``failing`` holds the root cause as soon as the request is
    known to fail; ``poll()`` turns FAILED only once no byte of it can land, so the slots do
    not change after FAILED; and the prefill's Send ends FAILED."""
    timeout = 60.0 if cause == "abort" else 0.3
    with pair(timeout) as (ref, driver, pre, dec):
        recv = dec.expect("r", pre.address, {"kv": [1, 2]})
        send = pre.offer("r")
        assert _until(lambda: recv.poll() is State.WAITING, 5)
        driver.hold = True
        send.write({"kv": [3, 4]}, last=True)
        assert _until(lambda: bool(driver.held), 5), "the write was never posted"
        aborting = threading.Thread(target=_abort, args=(recv,))
        if cause == "abort":
            aborting.start()
        # Well past dead_after_s: the defect reported FAILED by now.
        _until(lambda: recv.done, min(timeout, 1.0) + 4 * DEAD_AFTER_S)
        failed_early = recv.poll() is State.FAILED
        draining = recv.failing
        early = ref.dsts[0].snapshot()
        driver.land_all()  # the NIC finishes the write
        if cause == "abort":
            aborting.join(10)
        assert _until(lambda: recv.done and send.done, 10)
        at_failed = early if failed_early else ref.dsts[0].snapshot()
        time.sleep(0.05)  # anything still to land has had its chance
        now = ref.dsts[0].snapshot()
        changed = [k for k in now if not np.array_equal(now[k], at_failed[k])]
        assert not changed, f"bytes landed in {changed[:3]} after the Receive reported FAILED"
        assert recv.poll() is State.FAILED and recv.error is not None
        assert recv.error.stage == cause, recv.error
        assert isinstance(draining, RequestError) and str(draining) == str(recv.error)
        assert send.poll() is State.FAILED, f"the prefill's Send ended {send.poll().name}"
