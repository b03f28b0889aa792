"""Pairs: one per (decode rank, prefill rank), opened by ``Hello`` / ``Welcome`` and kept
alive by heartbeats.

A pair is the connection that completed the handshake, and everything a
message may touch is bound to it: the decode rank's place (TP rank, stage)
from its ``Hello``, and the driver address of each side's endpoint. An
endpoint may name only the memory of the peer that sent it: a ``Hello`` whose
endpoint is this rank's own, or another live pair's, is refused, and so is a
``Welcome`` naming a driver address another live pair holds. The prefill rank
plans the pair, then asks the data plane to connect (``Connect``), and sends
its ``Welcome`` once that is done; a failed handshake keeps only the peer's
name and the error. A pair that failed is retried by the next request that
needs it after a bounded exponential backoff: never a permanent blacklist.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
from dataclasses import dataclass
from typing import Any

from ..endpoint import endpoint_address
from ..errors import ManifestError, PlanError, ProtocolError
from ..manifest import Manifest
from ..planner import Plan, plan
from ..staging import FORCE, StagedPlan, stage
from . import actions as act
from . import wire
from .backoff import Backoff
from .core import MAX_PAIRS, Out, Settings, log
from .states import PairEvent

CACHED = 256 << 10
"""Manifests up to this size are decoded once for every pair that sends the same bytes (the
ranks of a group, reconnects): a handshake's largest cost after its plan."""


@functools.lru_cache(maxsize=16)
def _decoded(data: bytes) -> Manifest:
    return Manifest.decode(data)


def decoded(data: bytes) -> Manifest:
    """A peer's manifest (ManifestError for a malformed one, each time it is sent)."""
    return _decoded(data) if len(data) <= CACHED else Manifest.decode(data)


class Up:
    """A prefill rank as a decode rank sees it: our DEALER to its ROUTER."""

    def __init__(self, address: str, serial: int, now: float) -> None:
        self.address = address
        self.conn: act.Conn = ("up", address, serial)
        self.lost = False  # lost, its connection kept open until its aborts are answered
        self.welcome: wire.Welcome | None = None
        self.manifest: Manifest | None = None
        self.driver_name = ""
        self.endpoint = b""  # ours, as its Hello carried it (a fence that cuts all ends it)
        self.hello_at = now
        self.last_seen = now
        self.last_ping = now
        self.queued: list[wire.Message] = []  # sent once the Welcome came
        self.staged: StagedPlan | None = None  # its routes into this rank, once a request needs it

    @property
    def ready(self) -> bool:
        return self.welcome is not None

    def where(self) -> str:
        rank = "?" if self.welcome is None else self.welcome.tp_rank
        return f"prefill rank {rank} ({self.address})"


@dataclass(frozen=True, slots=True)
class Place:
    """Who a decode rank is, from its Hello: all a failed pair keeps of it."""

    address: str
    incarnation: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int


class Down:
    """A decode rank as a prefill rank sees it: a ROUTER identity that said Hello."""

    def __init__(self, ident: bytes, hello: wire.Hello, now: float) -> None:
        self.ident = ident
        self.conn: act.Conn = ("down", ident)
        self.place = Place(
            hello.address, hello.incarnation, hello.tp_rank, hello.tp_size, hello.pp_rank,
            hello.pp_size,
        )  # fmt: skip
        self.resume = hello.resume
        self.pokes = hello.pokes  # it polls its notifications: a Poke as each write ends
        self.driver_name = ""
        self.peer: Any = None
        self.generation = 0  # the decode rank's registration generation in its endpoint
        self.plan: Plan | None = None
        self.staged: StagedPlan | None = None  # None: every chunk goes direct
        self.error: tuple[str, str] | None = None
        self.ready = False
        self.hello_at = self.last_seen = now
        self.writes = 0  # our writes to it still in the driver
        self.lost = False  # once lost: nothing more is written to it

    @property
    def connecting(self) -> bool:
        """Our driver still connects to it (bounded by ``handshake_timeout_s``): it pings only
        once Welcomed, so its silence says nothing yet."""
        return not self.ready and self.error is None

    def where(self) -> str:
        return f"decode rank {self.place.tp_rank} ({self.place.address})"


class Pairs:
    """Both sides' pairs: opening, the handshake, heartbeats, losing them."""

    def __init__(self, s: Settings, out: Out) -> None:
        self.s, self.out = s, out
        self.ups: dict[str, Up] = {}  # live, by address
        self.conns: dict[act.Conn, Up] = {}  # live and lost-but-draining, by connection
        self._serial = 0
        self.by_driver: dict[str, Up] = {}
        self.backoff: dict[str, Backoff] = {}
        self.downs: dict[bytes, Down] = {}
        self.down_drivers: dict[str, Down] = {}
        self.endpoint = s.endpoint  # new after each fence: links from the old one are cut
        self.driver_name = s.driver_name  # ours, "backend:address": new after each fence too

    def renew(self, endpoint: bytes) -> None:
        """Our driver's endpoint after a fence: the next handshakes carry it, and a peer
        naming its address (our own memory) is refused as the first one was (the engine
        behind the old one is gone)."""
        self.endpoint = endpoint
        with contextlib.suppress(ProtocolError):
            self.driver_name = f"{self.s.backend}:{endpoint_address(endpoint)}"

    # -- decode side -----------------------------------------------------------------

    def open_up(self, address: str, now: float) -> Up | None:
        """Our pair with a prefill rank, opened (Hello sent) on first use; None while a failed
        pair waits out its backoff."""
        up = self.ups.get(address)
        if up is not None:
            return up
        backoff = self.backoff.get(address)
        if backoff is not None and now < backoff.retry_at:
            return None
        self._serial += 1
        up = self.ups[address] = Up(address, self._serial, now)
        self.conns[up.conn] = up
        self.out.add(act.Open(up.conn))
        s = self.s
        hello = wire.Hello(
            **self._me(), pp_rank=s.pp_rank, pp_size=s.pp_size, resume=s.resume(address),
            pokes=s.pokes,
        )  # fmt: skip
        up.endpoint = self.endpoint
        self.out.send(up.conn, hello)
        return up

    def drop_up(
        self, up: Up, now: float, why: str, linger_ms: int = 0, *, keep: bool = False
    ) -> None:
        """Forget ``up`` and back off before the next try; ``linger_ms`` lets messages just
        queued to it still leave. With ``keep`` its connection stays open (``lost``) so that
        the answers to its aborts can still come: ``close`` it once they have."""
        if self.ups.get(up.address) is up:
            del self.ups[up.address]
            event = "lost" if up.ready else "failed"
            self.out.add(act.Paired(PairEvent("decode", up.address, event, why)))
        up.lost = True
        if not keep:
            self.close(up, linger_ms)
        if self.by_driver.get(up.driver_name) is up:
            del self.by_driver[up.driver_name]
        s = self.s
        delay = self.backoff.setdefault(up.address, Backoff()).failed(
            now, s.reconnect_min_s, s.reconnect_max_s, s.rng
        )
        log.info(
            "%s: next handshake with %s in %.2f s at the earliest",
            self.s.address,
            up.address,
            delay,
        )

    def close(self, up: Up, linger_ms: int = 0) -> None:
        if self.conns.pop(up.conn, None) is not None:
            self.out.add(act.Close(up.conn, linger_ms))

    def welcome(self, up: Up, msg: wire.Welcome) -> tuple[str, str] | None:
        """Take ``up``'s Welcome; the (stage, text) why the pair cannot work, if it cannot."""
        if msg.version != wire.PROTOCOL_VERSION:
            return (
                "handshake",
                f"{up.address} speaks protocol {msg.version}, we speak {wire.PROTOCOL_VERSION}",
            )
        if msg.error:
            return (msg.stage or "handshake", msg.error)
        try:
            driver = f"{msg.backend}:{endpoint_address(msg.endpoint)}"
            up.manifest = decoded(msg.manifest)
        except (ProtocolError, ManifestError) as exc:
            return ("handshake", f"{up.address} sent a malformed introduction: {exc}")
        holder = self.by_driver.get(driver)
        if driver == self.driver_name or (holder is not None and holder is not up):
            who = "this rank" if holder is None else holder.where()
            return ("handshake", f"{up.address} named the driver address of {who} ({driver})")
        up.welcome, up.driver_name = msg, driver
        self.by_driver[driver] = up
        self.out.add(act.Paired(PairEvent("decode", up.address, "up")))
        self.backoff.pop(up.address, None)
        for queued in up.queued:
            self.out.send(up.conn, queued)
        up.queued.clear()
        return None

    # -- prefill side ----------------------------------------------------------------

    def resumed(self, msg: wire.Hello) -> Down | None:
        """The live pair a Hello on a new connection resumes: the same decode rank (its resume
        digest, address and incarnation) back after it declared the pair lost."""
        try:
            old = self.down_drivers.get(f"{msg.backend}:{endpoint_address(msg.endpoint)}")
        except ProtocolError:
            return None
        if old is None or not old.resume or not hmac.compare_digest(old.resume, msg.resume):
            return None
        return (
            old
            if (old.place.address, old.place.incarnation) == (msg.address, msg.incarnation)
            else None
        )

    def hello(self, ident: bytes, msg: wire.Hello, now: float) -> Down | None:
        """A decode rank's Hello: planned and connecting (``Connect``), or refused at once
        (its Welcome says why). None when it is refused without a pair kept."""
        where = self.s.where("prefill")
        if len(self.downs) >= MAX_PAIRS:
            text = f"{where} holds {MAX_PAIRS} pairs already (MAX_PAIRS): refused"
            self.out.send(("down", ident), self._welcome("handshake", text))
            return None
        down = self.downs[ident] = Down(ident, msg, now)
        try:
            driver = f"{msg.backend}:{endpoint_address(msg.endpoint)}"
        except ProtocolError as exc:
            return self._refuse(
                down, "handshake", f"{msg.address} sent a malformed endpoint: {exc}"
            )
        holder = self.down_drivers.get(driver)
        if msg.version != wire.PROTOCOL_VERSION:
            v = wire.PROTOCOL_VERSION
            why = f"{where} speaks protocol {v}, {msg.address} speaks {msg.version}"
            return self._refuse(down, "handshake", why)
        if msg.backend != self.s.backend:
            why = f"{where} uses backend {self.s.backend}, {msg.address} uses {msg.backend}"
            return self._refuse(down, "handshake", why)
        if driver == self.driver_name or holder is not None:
            # Who it claims to be is wrong: nothing of it is kept, nothing it says counts.
            who = "this rank's own memory" if holder is None else f"the memory of {holder.where()}"
            why = f"{msg.address}'s endpoint names {who} ({driver}): refused"
            self._refuse(down, "handshake", why)
            del self.downs[ident]
            return None
        try:
            manifest = decoded(msg.manifest)
            down.plan = plan(self.s.manifest, manifest)  # what its Hello advertised: ``manifests``
            if self.s.staging in FORCE:
                down.staged = stage(
                    down.plan,
                    descriptor_bytes=self.s.descriptor_bytes,
                    copy_cost=self.s.copy_cost,
                    force=FORCE[self.s.staging],
                )
        except PlanError as exc:
            why = f"plan from {where} to decode rank {msg.tp_rank} ({msg.address}): {exc}"
            return self._refuse(down, "plan", why)
        except ManifestError as exc:
            return self._refuse(
                down, "handshake", f"{msg.address} sent a malformed manifest: {exc}"
            )
        down.driver_name = driver
        self.down_drivers[driver] = down
        self.out.add(act.Connect(ident, msg.endpoint, manifest))
        return down

    def connected(
        self, ident: bytes, peer: Any, generation: int, error: str, now: float
    ) -> Down | None:
        """The data plane connected (or failed to) for ``ident``'s Hello: send the Welcome."""
        down = self.downs.get(ident)
        if down is None or down.ready or down.error is not None:
            if peer is not None:  # replaced or lost meanwhile
                self.out.add(act.Disconnect(peer))
            return None
        if error:
            where = self.s.where("prefill")
            why = f"{where} cannot reach {down.where()}: {error}"
            self._refuse(down, "handshake", why)
            return down
        down.peer, down.generation, down.ready = peer, generation, True
        down.last_seen = now  # it pings once Welcomed: its silence counts from here
        self.out.send(down.conn, self._welcome())
        self.out.add(act.Paired(PairEvent("prefill", down.place.address, "up")))
        return down

    def _refuse(self, down: Down, stage: str, why: str) -> Down:
        log.warning("%s: %s", self.s.address, why)
        self.out.add(act.Paired(PairEvent("prefill", down.place.address, "failed", why)))
        down.error = (stage, wire.clip(why))
        down.plan = down.staged = None
        if self.down_drivers.get(down.driver_name) is down:
            del self.down_drivers[down.driver_name]
        self.out.send(down.conn, self._welcome(stage, why))
        return down

    def _me(self) -> dict[str, Any]:
        return self.s.hello() | {"endpoint": self.endpoint}

    def _welcome(self, stage: str = "", error: str = "") -> wire.Welcome:
        s = self.s
        return wire.Welcome(
            **self._me(),
            stage=stage,
            error=error,
            drain_s=s.drain_s,
            staging=s.staging,
            descriptor_bytes=s.descriptor_bytes,
            copy_cost=s.copy_cost,
            slice_bytes=s.arena.slice_bytes,
        )

    def drop_down(self, down: Down, why: str) -> None:
        if self.downs.get(down.ident) is down:
            del self.downs[down.ident]
            if down.ready:
                self.out.add(act.Paired(PairEvent("prefill", down.place.address, "lost", why)))
        if self.down_drivers.get(down.driver_name) is down:
            del self.down_drivers[down.driver_name]

    # -- heartbeats --------------------------------------------------------------------

    def tick(self, now: float) -> tuple[list[tuple[Up, str, str]], list[tuple[Down, str]]]:
        """Ping what is due; the pairs lost to silence: (up, why, stage), (down, why)."""
        s = self.s
        lost_ups: list[tuple[Up, str, str]] = []
        for up in self.ups.values():
            if not up.ready:
                if now - up.hello_at > s.handshake_timeout_s:
                    why = (
                        f"no handshake reply from {up.address} within {s.handshake_timeout_s} s "
                        "(not running or unreachable)"
                    )
                    lost_ups.append((up, why, "handshake"))
            elif now - up.last_seen > s.dead_after_s:
                why = (
                    f"{up.where()} sent nothing for {now - up.last_seen:.1f} s "
                    f"(dead_after_s={s.dead_after_s})"
                )
                lost_ups.append((up, why, "peer lost"))
            elif now - up.last_ping >= s.heartbeat_s:
                up.last_ping = now
                self.out.send(up.conn, wire.Ping(incarnation=s.incarnation))
        lost_downs = []
        for d in self.downs.values():
            if now > self._due(d):
                silent = (
                    f"sent nothing for {now - d.last_seen:.1f} s (dead_after_s={s.dead_after_s})"
                )
                slow = f"was not connected to within handshake_timeout_s={s.handshake_timeout_s}"
                lost_downs.append((d, f"{d.where()} {slow if d.connecting else silent}"))
        return lost_ups, lost_downs

    def next_deadline(self) -> float:
        """When ``tick`` has something to do at the earliest."""
        s = self.s
        times = [
            (up.last_ping + s.heartbeat_s) if up.ready else (up.hello_at + s.handshake_timeout_s)
            for up in self.ups.values()
        ]
        times += [self._due(d) for d in self.downs.values()]
        return min(times, default=float("inf"))

    def _due(self, d: Down) -> float:
        """When ``d`` is lost unless it speaks: its connect counts from its Hello, whatever it
        says meanwhile (a driver's connect that never returns still ends)."""
        s = self.s
        return d.hello_at + s.handshake_timeout_s if d.connecting else d.last_seen + s.dead_after_s
