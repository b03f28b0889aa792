"""Liveness and deadlines: heartbeats per peer, peers lost, requests past their time, close.

Each decode rank pings every prefill rank it has a pair with every
``heartbeat_s`` (per peer, never per request); any message counts as a sign
of life, and a peer silent for ``dead_after_s`` is lost on both sides: every
request that needs it fails (stage ``peer lost``) and the pair backs off
before the next request tries it again.
"""

from __future__ import annotations

import logging
import time

from ..errors import XferError
from . import wire
from .core import DRAIN_S, Core, log
from .handshake import Down, Up
from .prefill import Drain


class Liveness(Core):
    """The timers of the I/O thread, and what happens when a peer is gone."""

    def _lose_up(self, up: Up, why: str, stage: str = "peer lost") -> None:
        """A prefill rank is gone (dead, restarted, closed, unreachable): fail what needs it."""
        self._drop_up(up)
        self._pair_failed(up.address)
        self._forget_group_of(up.address)
        quiet = frozenset({up.address})
        hit = [r for r in self._recvs.values() if up.address in r.sources]
        log.log(logging.WARNING if hit else logging.INFO, "%s: %s", self.address, why)
        for rec in hit:
            self._fail_recv(rec, stage, why, up.address, quiet=quiet)

    def _lose_down(self, down: Down, why: str) -> None:
        """A decode rank is gone: fail its requests; disconnect once their writes drained."""
        mine = [d for r in self._sends.values() for d in r.dsts.values() if d.down is down]
        log.log(logging.WARNING if mine else logging.INFO, "%s: %s", self.address, why)
        if self._downs.get(down.ident) is down:
            del self._downs[down.ident]
        for rec in list(self._sends.values()):
            if any(d.down is down for d in rec.dsts.values()):
                self._fail_send(rec, "peer lost", why, gone=down)
        if down.peer is None:
            return
        peer = down.peer

        def disconnect() -> None:
            try:
                self.backend.disconnect(peer)
            except XferError as exc:
                log.warning("%s: disconnecting %s: %s", self.address, down.where(), exc)

        drain = Drain(None, [t for d in mine for t, _ in d.transfers], disconnect)
        if drain.settled(time.monotonic()):
            disconnect()
        else:
            self._drains.append(drain)

    def _tick(self, now: float) -> None:
        for up in list(self._ups.values()):
            if not up.ready:
                if now - up.hello_at > self.handshake_timeout_s:
                    self._lose_up(
                        up,
                        f"no handshake reply from {up.address} within {self.handshake_timeout_s} s "
                        "(not running, unreachable, or refusing our key)",
                        stage="handshake",
                    )
                continue
            if now - up.last_seen > self.dead_after_s:
                self._lose_up(
                    up,
                    f"{up.where()} sent nothing for {now - up.last_seen:.1f} s "
                    f"(dead_after_s={self.dead_after_s})",
                )
            elif now - up.last_ping >= self.heartbeat_s:
                up.last_ping = now
                self._to_up(up, wire.Ping(incarnation=self.incarnation))
        for down in list(self._downs.values()):
            if now - down.last_seen > self.dead_after_s:
                self._lose_down(
                    down,
                    f"{down.where()} sent nothing for {now - down.last_seen:.1f} s "
                    f"(dead_after_s={self.dead_after_s})",
                )
        self._tick_groups(now)
        for rec in list(self._recvs.values()):
            if rec.error is None and now > rec.deadline:
                self._fail_recv(
                    rec,
                    "timeout",
                    f"not done within request_timeout_s={self.request_timeout_s}",
                    None,
                )
            elif rec.error is None and not rec.started:
                self._on_sources(rec)  # a pair that was backing off may be tried now
            elif rec.error is not None and now > rec.drain_at + self.dead_after_s:
                log.warning(
                    "%s: request %r: no abort confirmation from %s",
                    self.address,
                    rec.rid,
                    sorted(rec.acks),
                )
                rec.acks.clear()
                self._settle_recv(rec)
        for srec in list(self._sends.values()):
            if srec.lease_until is not None:
                if now > srec.lease_until:
                    self._fail_send(
                        srec,
                        "timeout",
                        f"written and held, but no decode rank claimed it within "
                        f"lease_s={self.lease_s} (nothing was written)",
                    )
            elif now > srec.deadline:
                self._fail_send(
                    srec, "timeout", f"not done within request_timeout_s={self.request_timeout_s}"
                )

    def _shutdown(self, stage: str, why: str) -> None:
        """Fail every open request on both sides, drain, say ``Bye``, close the DEALERs."""
        for rec in list(self._recvs.values()):
            if rec.error is None:
                self._fail_recv(rec, stage, why, None)
            rec.acks.clear()  # we cannot wait: our memory is about to be released
            self._settle_recv(rec)
        for srec in list(self._sends.values()):
            self._fail_send(srec, stage, why)
        limit = time.monotonic() + DRAIN_S
        while self._drains and time.monotonic() < limit:
            self._poll_drains()
            time.sleep(0.002)
        for drain in self._drains:  # past DRAIN_S (logged): settle anyway
            drain.then()
        self._drains.clear()
        bye = wire.Bye(incarnation=self.incarnation, reason=why)
        for up in list(self._ups.values()):
            self._to_up(up, bye)
        for down in list(self._downs.values()):
            self._to_down(down.ident, bye)
        self._leave_group()
        time.sleep(0.05)  # let the byes leave before the sockets close (linger is 0)
        for up in list(self._ups.values()):
            self._drop_up(up)
