"""The handshake, once per (decode rank, prefill rank) pair: ``Hello`` / ``Welcome``.

Each side learns the other's manifest, backend endpoint, TP place and
incarnation; the prefill rank plans the pair and connects its backend, and a
plan or endpoint error travels back in the ``Welcome`` so both sides report
the same text. A pair that failed is retried by the next request that needs
it, after a bounded exponential backoff: never a permanent blacklist.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import zmq

from ..backend import Peer
from ..errors import ManifestError, PlanError, XferError
from ..manifest import Manifest
from ..planner import Plan, plan
from ..staging import FORCE, StagedPlan, stage
from . import wire
from .core import LINGER_MS, Core, log, stage_text


def fingerprint(manifest: Manifest) -> str:
    """A TP-independent digest of the layout: per region key its global slot shape, itemsize
    and sharding. Two engines serving one model agree on it (diagnostics; the plan decides)."""
    h = hashlib.sha256()
    for r in sorted(manifest.regions, key=lambda r: r.key):
        shape = list(r.slot_shape)
        if r.tp_axis is not None:
            shape[r.tp_axis] = r.tp_global or shape[r.tp_axis] * manifest.tp_size
        h.update(repr((r.key, shape, r.itemsize, r.tp_axis, r.tp_groups)).encode())
    return h.hexdigest()[:16]


class Up:
    """A prefill rank as a decode rank sees it: our DEALER to its ROUTER."""

    def __init__(self, address: str, sock: zmq.Socket[Any], now: float) -> None:
        self.address = address
        self.sock = sock
        self.welcome: wire.Welcome | None = None
        self.manifest: Manifest | None = None
        self.driver_name = ""
        self.hello_at = now
        self.last_seen = now
        self.last_ping = now
        self.queued: list[wire.Message] = []  # sent once the Welcome came (renewals)
        self.staged: StagedPlan | None = None  # its routes into this rank, once a request needs it

    @property
    def ready(self) -> bool:
        return self.welcome is not None

    def where(self) -> str:
        rank = "?" if self.welcome is None else self.welcome.tp_rank
        return f"prefill rank {rank} ({self.address})"


class Down:
    """A decode rank as a prefill rank sees it: a ROUTER identity that said Hello."""

    def __init__(self, ident: bytes, hello: wire.Hello, now: float) -> None:
        self.ident = ident
        self.hello = hello
        self.manifest: Manifest | None = None
        self.peer: Peer | None = None
        self.plan: Plan | None = None
        self.staged: StagedPlan | None = None  # None: every chunk goes direct
        self.error: tuple[str, str] | None = None
        self.last_seen = now

    def where(self) -> str:
        return f"decode rank {self.hello.tp_rank} ({self.hello.address})"


class Backoff:
    """When a peer that failed may be tried again: exponential, bounded, reset by a Welcome."""

    __slots__ = ("failures", "retry_at")

    def __init__(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def failed(self, now: float, low: float, high: float) -> float:
        """Record one more failure; the delay before the next try (jittered, at most ``high``)."""
        delay = min(high, low * 2.0**self.failures) * random.uniform(0.5, 1.0)
        self.failures += 1
        self.retry_at = now + delay
        return delay


class Handshake(Core):
    """Opening pairs on both sides, and the backoff between tries."""

    def _hello(self) -> dict[str, Any]:
        return {
            "version": wire.PROTOCOL_VERSION,
            "incarnation": self.incarnation,
            "address": self.address,
            "tp_rank": self.manifest.tp_rank,
            "tp_size": self.manifest.tp_size,
            "fingerprint": self._fingerprint,
            "manifest": self.manifest.encode(),
            "backend": self.backend.name,
            "endpoint": self._endpoint,
            "driver_address": str(self.backend.driver.address),
        }

    _endpoint: bytes
    _fingerprint: str

    # -- decode side -----------------------------------------------------------------

    def _open_up(self, address: str, now: float) -> Up | str | None:
        """Our pair with a prefill rank, opened (Hello sent) on first use; None while a failed
        pair waits out its backoff; or why it cannot be opened."""
        up = self._ups.get(address)
        if up is not None:
            return up
        backoff = self._backoff.get(address)
        if backoff is not None and now < backoff.retry_at:
            return None
        sock = self._dealer(address)
        if isinstance(sock, str):
            return sock
        up = self._ups[address] = Up(address, sock, now)
        self._watch(sock, lambda: self._drain_up(up))
        self._to_up(up, wire.Hello(**self._hello()))
        return up

    def _pair_failed(self, address: str) -> None:
        """Back off before the next try of ``address``."""
        backoff = self._backoff.setdefault(address, Backoff())
        delay = backoff.failed(time.monotonic(), self.reconnect_min_s, self.reconnect_max_s)
        log.info(
            "%s: next handshake with %s in %.2f s at the earliest", self.address, address, delay
        )

    def _drop_up(self, up: Up, linger_ms: int = 0) -> None:
        """Forget ``up``; ``linger_ms`` lets messages just queued to it still leave."""
        if self._ups.get(up.address) is up:
            del self._ups[up.address]
        if self._by_driver.get(up.driver_name) is up:
            del self._by_driver[up.driver_name]
        self._unwatch(up.sock)
        up.sock.close(linger=linger_ms)

    def _on_welcome(self, up: Up, msg: wire.Welcome) -> None:
        if up.welcome is not None:
            log.warning("%s: a second Welcome from %s: dropped", self.address, up.address)
            return
        waiting = [r for r in self._recvs.values() if up.address in r.sources and not r.started]
        problem: tuple[str, str] | None = None
        if msg.version != wire.PROTOCOL_VERSION:
            problem = (
                "handshake",
                f"{up.address} speaks protocol {msg.version}, we speak {wire.PROTOCOL_VERSION}",
            )
        elif msg.error:
            problem = (msg.stage or "handshake", msg.error)
        else:
            try:
                up.manifest = Manifest.decode(msg.manifest)
            except ManifestError as exc:
                problem = ("handshake", f"{up.address} sent a malformed manifest: {exc}")
        if problem is not None:
            stage, text = problem
            me = self.where("decode")
            texts = {  # the prefill side's own text when it sent one
                rec.rid: text if msg.error else stage_text(rec.rid, stage, me, text)
                for rec in waiting
            }
            for rec in waiting:  # so an offer there fails with the same text, not a timeout
                self._to_up(
                    up, wire.Fail(rid=rec.rid, gen=rec.gen, stage=stage, text=texts[rec.rid])
                )
            # The Fails above must still leave: closed at once, ZMQ drops them (the prefill's
            # offer then waited out its lease instead of failing with this text).
            self._drop_up(up, linger_ms=LINGER_MS)
            self._pair_failed(up.address)
            for rec in waiting:
                self._fail_recv(rec, stage, texts[rec.rid], up.address, formatted=True)
            return
        up.welcome = msg
        up.driver_name = f"{msg.backend}:{msg.driver_address}"
        self._by_driver[up.driver_name] = up
        self._backoff.pop(up.address, None)
        for queued in up.queued:
            self._to_up(up, queued)
        up.queued.clear()
        for rec in waiting:
            self._try_start(rec)

    # -- prefill side ----------------------------------------------------------------

    def _on_hello(self, ident: bytes, msg: wire.Hello) -> None:
        old = self._downs.get(ident)
        if old is not None:
            self._lose_down(old, f"{old.where()} said Hello again: starting over")
        down = Down(ident, msg, time.monotonic())
        reply = self._hello()
        where = self.where("prefill")
        if msg.version != wire.PROTOCOL_VERSION:
            down.error = (
                "handshake",
                f"{where} speaks protocol {wire.PROTOCOL_VERSION}, "
                f"{msg.address} speaks {msg.version}",
            )
        elif msg.backend != self.backend.name:
            down.error = (
                "handshake",
                f"{where} uses backend {self.backend.name}, {msg.address} uses {msg.backend}",
            )
        else:
            try:
                down.manifest = Manifest.decode(msg.manifest)
                down.plan = plan(self.manifest, down.manifest)
                if self.staging in FORCE:
                    caps = self.backend.capabilities
                    down.staged = stage(
                        down.plan,
                        descriptor_bytes=caps.descriptor_bytes,
                        copy_cost=caps.copy_cost,
                        force=FORCE[self.staging],
                    )
                down.peer = self.backend.connect(msg.endpoint, down.manifest)
            except PlanError as exc:
                down.error = (
                    "plan",
                    f"plan from {where} to decode rank {msg.tp_rank} ({msg.address}): {exc}",
                )
            except XferError as exc:
                down.error = (
                    "handshake",
                    f"{where} cannot reach decode rank {msg.tp_rank} ({msg.address}): {exc}",
                )
        if down.error is not None:
            log.warning("%s: %s", self.address, down.error[1])
            reply.update(stage=down.error[0], error=down.error[1])
        reply.update(
            staging=self.staging,
            descriptor_bytes=self.backend.capabilities.descriptor_bytes,
            copy_cost=self.backend.capabilities.copy_cost,
            slice_bytes=self._slices.slice_bytes,
        )
        self._downs[ident] = down
        self._to_down(ident, wire.Welcome(**reply))
