"""A third peer with a trusted key: it replays, forges and floods every message type.

It plays both roles: towards prefill ranks a decode rank (``Hostile.act``; it
also joins the instance's group at any place, for ``PREFILL``), and
towards decode ranks a prefill rank at ``PREFILL``, an address some requests
are fetched from (``Hostile.from_decode``): it welcomes them with its own
endpoint (or, under ``impersonate``, an honest prefill rank's Welcome as it
was sent), then forges ``Fail``, ``AbortAck``, ``Written``, ``Pong`` and ``Bye``
for any request, with the generations it saw and the ones near them.

It knows what any peer could learn (request ids, addresses, every message a
decode rank sends) but no secret: a replayed ``Hello`` carries a resume
digest it made up, and its own driver's endpoint, unless ``impersonate``
(harsh) lets it present the endpoint of a decode rank whose pair is not live,
which nothing in the control plane can tell from that rank's own (see
docs/reliability.md). What it sends goes through the wire codec, as the shell
decodes it; what the codec refuses never reaches a core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ...driver import CONTRACT_VERSION
from ...endpoint import Envelope
from ...errors import ProtocolError
from ...session import wire

if TYPE_CHECKING:
    from .network import Link
    from .world import Rank, World

HOSTILE_DRIVER = "hostile-drv"
"""Its own driver's address: a connection to it works (writes land in its own memory); it
may also present one that cannot be reached (``hostile-gone-drv``)."""
FLOOD = 16
"""Messages in one flood."""
HOSTILE = "hostile"
"""Its identities' prefix; every text it makes up names it, so the checker can tell."""
FORGED = f"forged by the {HOSTILE} peer"
"""The root cause its forged Fail, Abort and Bye messages give."""
PREFILL = f"{HOSTILE}-prefill"
"""The prefill address it serves: decode ranks told to fetch a request from it pair with it."""


class Hostile:
    def __init__(self, world: World) -> None:
        self.w = world
        self.serial = 0
        self.links: list[Link] = []  # decode ranks' connections to PREFILL that said Hello
        self.incarnations: dict[int, int] = {}  # id(link) -> the incarnation it welcomed with
        self.until: dict[int, float] = {}  # id(link) -> when it stops answering Pings
        self.gens: list[int] = [1]  # generations seen in their Requests
        self.asked: set[int] = set()  # uses a decode rank asked it for (its group named it)

    def start(self) -> None:
        rng, c = self.w.rng, self.w.config
        for _ in range(rng.randint(1, c.hostile_acts)):
            self.w.at(rng.uniform(0.0, c.arrivals_s + 5.0), self.act)
        for _ in range(rng.randint(0, c.hostile_acts)):
            self.w.at(rng.uniform(0.0, c.arrivals_s + 5.0), self.act_as_prefill)

    def act(self) -> None:
        """A burst on one connection; half of the time a new one, which says Hello first and
        claims the next request ids once it is welcomed."""
        rng = self.w.rng
        target = self.w.ranks[rng.choice(self.w.prefill)]
        hellos = [m for m in self.w.net.captured if isinstance(m, wire.Hello)]
        burst = [self._message() for _ in range(FLOOD if rng.random() < 0.2 else rng.randint(1, 3))]
        if self.serial == 0 or (hellos and rng.random() < 0.5):
            self.serial += 1
            if hellos:
                ident = f"{HOSTILE}.{self.serial}".encode()
                self._send(target, ident, [self._disguised(rng.choice(hellos))])
                later = self.w.now + rng.uniform(0.02, 0.5)
                self.w.at(later, self._send, target, ident, [*self._claims(), *burst])
                return
        self._send(target, f"{HOSTILE}.{self.serial}".encode(), burst)

    def _send(self, target: Rank, ident: bytes, burst: list[wire.Message]) -> None:
        for msg in burst:
            try:  # as the shell receives it: bytes through the codec
                msg = wire.decode(wire.encode(msg))
            except (ProtocolError, msgspec.ValidationError):
                continue
            if target.alive and target.paused_until <= self.w.now:
                self.w.call(target, "receive", ("down", ident), msg)

    def _claims(self) -> list[wire.Message]:
        uses, rng = len(self.w.engine.uses), self.w.rng
        return [
            wire.Request(
                rid=f"r{uses + i}", gen=rng.getrandbits(16), needed=True, registration=1,
                slots=wire.pack_slots({  # room for any request the engine makes
                    "kv": rng.sample(range(self.w.config.kv_slots), 4),
                    "state": [rng.randrange(self.w.config.state_slots)],
                }),
            )
            for i in range(2)
        ]  # fmt: skip

    def _disguised(self, msg: wire.Hello) -> wire.Hello:
        """A decode rank's Hello as the hostile peer can send it: no secret (a made-up resume
        digest) and, unless ``impersonate``, its own endpoint."""
        rng = self.w.rng
        msg = msgspec.structs.replace(msg, resume=rng.randbytes(16))
        if "impersonate" in self.w.config.faults:  # a decode rank's endpoint
            if rng.random() < 0.5:  # and maybe its own driver address declared
                msg = msgspec.structs.replace(msg, driver_address=HOSTILE_DRIVER)
            return msg
        driver = rng.choice([HOSTILE_DRIVER, f"{HOSTILE}-gone-drv"])  # it may be unreachable
        endpoint = msgspec.msgpack.encode(
            Envelope("sim", CONTRACT_VERSION, "host", 1, driver, 1, msgspec.Raw(b"\x90"))
        )
        return msgspec.structs.replace(msg, endpoint=endpoint, driver_address=driver)

    def _message(self) -> wire.Message:
        rng = self.w.rng
        captured = self.w.net.captured
        uses = len(self.w.engine.uses)  # ids are guessable: the next ones too
        rid = rng.choice([u.rid for u in self.w.engine.uses[-8:]] + [f"r{uses}", f"r{uses + 1}"])
        gen = rng.choice([0, 1, 2, rng.getrandbits(32)])
        x = rng.random()
        if captured and x < 0.4:
            msg = rng.choice(list(captured))
            return self._disguised(msg) if isinstance(msg, wire.Hello) else msg
        if x < 0.5:
            return wire.Abort(rid=rid, gen=gen, stage="abort", text=FORGED)
        if x < 0.6:
            return wire.Fail(rid=rid, gen=gen, stage="transfer", text=FORGED)
        if x < 0.7:
            return wire.Unpacked(rid=rid, gen=gen, chunk=0, index=0)
        if x < 0.8:
            return wire.Renew(rids=[rid])
        if x < 0.85:
            slots = {"kv": [rng.randrange(self.w.config.kv_slots)]}
            return wire.Request(
                rid=rid, gen=gen, needed=True, slots=wire.pack_slots(slots),
                registration=rng.choice([0, 1]),
            )  # fmt: skip
        if x < 0.95:  # a place in the group's roster, for its prefill address (or beyond)
            tp, pp = self.w.config.prefill_tp, self.w.config.prefill_pp
            return wire.Join(incarnation=gen, address=PREFILL, tp_rank=rng.randint(0, tp),
                             tp_size=tp, pp_rank=rng.randint(0, pp), pp_size=pp)  # fmt: skip
        return wire.Ping(incarnation=gen)

    # -- as a prefill rank -------------------------------------------------------------

    def from_decode(self, link: Link, msg: wire.Message) -> None:
        """What a decode rank sent to ``PREFILL``: a Hello is welcomed, a Ping answered."""
        rng = self.w.rng
        if isinstance(msg, wire.Hello):
            welcomes = self.w.net.welcomes
            if not welcomes:
                return  # nothing to pass for a prefill rank with yet: no answer
            self.links.append(link)
            welcome = rng.choice(list(welcomes))
            if "impersonate" not in self.w.config.faults or rng.random() < 0.5:
                endpoint = msgspec.msgpack.encode(
                    Envelope("sim", CONTRACT_VERSION, "host", 1, HOSTILE_DRIVER, 1,
                             msgspec.Raw(b"\x90"))
                )  # fmt: skip
                welcome = msgspec.structs.replace(welcome, endpoint=endpoint)
            self.incarnations[id(link)] = welcome.incarnation
            self.until[id(link)] = self.w.now + rng.uniform(0.0, 10.0)  # then it goes silent
            self.w.net.reply(link, welcome)  # else as an honest rank sent it: its driver named
        elif isinstance(msg, wire.Ping) and self.until.get(id(link), 0.0) > self.w.now:
            self.w.net.reply(link, wire.Pong(incarnation=self.incarnations[id(link)]))
        elif isinstance(msg, wire.Request):
            self.gens.append(msg.gen)
            serial = self.w.ranks[link.dec].memory.serials.get((msg.rid, msg.gen))
            if serial is not None:
                self.asked.add(serial)

    def act_as_prefill(self) -> None:
        """A burst of forged prefill messages on one decode rank's connection to it."""
        rng = self.w.rng
        if not self.links:
            return
        link = rng.choice(self.links)
        n = FLOOD if rng.random() < 0.2 else rng.randint(1, 3)
        for _ in range(n):
            self.w.net.reply(link, self._forged())

    def _forged(self) -> wire.Message:
        rng = self.w.rng
        uses = [*self.w.engine.uses[-8:], *self.w.engine.decoys]
        rid = rng.choice([u.rid for u in uses] or ["r0"])
        gen = rng.choice(self.gens[-4:]) + rng.choice([-2, -1, 0, 0, 1, 2, 3])
        gen = max(gen, 0)
        x = rng.random()
        if x < 0.35:
            return wire.Fail(rid=rid, gen=gen, stage="transfer", text=FORGED)
        if x < 0.55:
            return wire.AbortAck(rid=rid, gen=gen)
        if x < 0.85:
            total = rng.randint(1, 3) if rng.random() < 0.5 else 0
            src_rank, seq = rng.randrange(2), rng.randrange(3)
            return wire.Written(rid=rid, gen=gen, src_rank=src_rank, seq=seq, total=total)
        if x < 0.95:
            return wire.Pong(incarnation=rng.getrandbits(16))
        return wire.Bye(incarnation=0, reason=FORGED)
