"""One Session rank in its own process, driven over JSON lines on stdin/stdout.

Both ends build the same ``Reference`` (same specs and seed), so the rank can
check the bytes it received without any bytes crossing the pipe. Run as a
script: ``python tests/session/session_rank.py``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

import xferkit as xk
from xferkit.session import Receive, Send, Session, SessionKeys
from xferkit.testing import Reference, RegionSpec, gdn_hybrid

Slots = dict[str, list[int]]


class Setup(msgspec.Struct, tag=True):
    role: str  # "src" or "dst"
    index: int
    src_tp: int
    dst_tp: int
    backend: str = "loopback"
    options: dict[str, Any] = {}
    keys: tuple[str, str, list[str]] | None = None  # public, secret, trusted
    session: dict[str, Any] = {}
    seed: int = 0
    bind: str = "tcp://127.0.0.1:0"
    group: str = ""  # the session address of the rank serving this rank's group roster
    layers: int = 4  # gdn_hybrid layers: more layers, more descriptors per request
    slots: dict[str, int] = {}  # slots per pool, both sides (default SLOTS)
    views: bool = False  # KV pages NHD on prefill, HND of twice the tokens on decode (VIEWS)
    page: int = 8  # tokens per KV page: larger pages, more bytes per slot


class Expect(msgspec.Struct, tag=True):
    rid: str
    sources: list[str]
    slots: Slots


class Offer(msgspec.Struct, tag=True):
    rid: str


class Write(msgspec.Struct, tag=True):
    rid: str
    slots: Slots
    last: bool = False


class Wait(msgspec.Struct, tag=True):
    rid: str
    timeout: float = 10.0


class Abort(msgspec.Struct, tag=True):
    rid: str
    timeout: float = 10.0


class Check(msgspec.Struct, tag=True):
    slots: dict[str, tuple[list[int], list[int]]]


class Fill(msgspec.Struct, tag=True):
    """Overwrite these destination slots with ``value`` (the engine reuses them)."""

    slots: Slots
    value: int


class Verify(msgspec.Struct, tag=True):
    """Fail unless these destination slots still hold ``value`` everywhere."""

    slots: Slots
    value: int


class Stray(msgspec.Struct, tag=True):
    """How many bytes of these destination slots no longer hold ``value`` (``count``, of
    ``total``), and which slots (``error``): what landed after ``Fill`` reused them."""

    slots: Slots
    value: int


class Landed(msgspec.Struct, tag=True):
    """How many (region, slot) cells of a request already hold the reference bytes."""

    slots: dict[str, tuple[list[int], list[int]]]


class Scrub(msgspec.Struct, tag=True):
    """Fill the staging no request holds now with ``value`` (``count``: bytes filled)."""

    value: int


class Stained(msgspec.Struct, tag=True):
    """How many bytes of the staging ``Scrub`` filled no longer hold ``value`` (``count``, of
    ``total``; ``error``: the first offset): what landed there after no request held it."""

    value: int


class Renew(msgspec.Struct, tag=True):
    """Decode side, before Expect: ask the sources to keep holding ``rid``."""

    rid: str
    sources: list[str]


class Forget(msgspec.Struct, tag=True):
    """Drop this rank's handle of ``rid`` (a soak keeps no handle of an ended request)."""

    rid: str


class Quit(msgspec.Struct, tag=True):
    pass


Command = (
    Setup
    | Expect
    | Offer
    | Write
    | Wait
    | Abort
    | Check
    | Fill
    | Verify
    | Stray
    | Landed
    | Quit
    | Renew
    | Forget
    | Scrub
    | Stained
)


class Reply(msgspec.Struct):
    ok: bool
    error: str = ""
    address: str = ""
    state: str = ""
    stage: str = ""
    elapsed: float = 0.0
    count: int = 0
    total: int = 0
    failing: str = ""  # Wait: the root cause once known, while the request may still drain


SLOTS = {"kv": 32, "state": 8}

BACKENDS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"},
    "nixl": {},
}
"""Every driver a rank can run on this machine, with the options it opens with (``Setup``)."""


def _views(spec: RegionSpec) -> RegionSpec:
    """KV pages ``[token, head, dim]`` on prefill, ``[head, token, dim]`` of two prefill pages
    on decode: what the planner cannot move without a transposition and a page map."""
    if spec.pool != "kv":
        return spec
    return msgspec.structs.replace(
        spec, axes=(xk.PAGE_AXIS, "head", "dim"), dst_order=(1, 0, 2), dst_pages=2
    )


def reference(
    src_tp: int,
    dst_tp: int,
    seed: int,
    layers: int = 4,
    slots: dict[str, int] | None = None,
    views: bool = False,
    page: int = 8,
) -> Reference:
    counts = slots or SLOTS
    specs = gdn_hybrid(layers, page=page)
    return Reference(
        [_views(s) for s in specs] if views else specs,
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots=counts,
        dst_slots=counts,
        seed=seed,
    )


def _cells(ref: Reference, index: int, slots: Slots) -> list[tuple[np.ndarray, np.ndarray]]:
    """(array, rows named by ``slots``) for every non-empty region of dst rank ``index``."""
    out = []
    for key, arr in ref.dsts[index].arrays.items():
        if key[0] in slots and arr.size:
            out.append((arr, np.asarray(slots[key[0]], dtype=np.int64)))
    return out


def serve() -> None:
    if logs := os.environ.get("XK_RANK_LOGS"):  # a folder: each rank logs at INFO to its file
        fmt = "%(asctime)s %(threadName)s %(message)s"
        logging.basicConfig(level=logging.INFO, filename=f"{logs}/{os.getpid()}.log", format=fmt)
    else:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    decoder = msgspec.json.Decoder(Command)
    session: Session | None = None
    ref: Reference | None = None
    index = 0
    handles: dict[str, Receive | Send] = {}
    scrubbed: list[slice] = []  # the staging Scrub filled, as offsets into its buffer
    for line in sys.stdin:
        cmd = decoder.decode(line)
        started = time.monotonic()
        reply = Reply(True)
        try:
            if isinstance(cmd, Quit):
                break
            if isinstance(cmd, Setup):
                ref = reference(
                    cmd.src_tp, cmd.dst_tp, cmd.seed, cmd.layers, cmd.slots, cmd.views, cmd.page
                )
                index = cmd.index
                rank = (ref.srcs if cmd.role == "src" else ref.dsts)[index]
                keys = None if cmd.keys is None else SessionKeys(*cmd.keys)
                backend = xk.open_backend(cmd.backend, **cmd.options)
                group = cmd.group or None
                session = Session(
                    backend,
                    rank.manifest,
                    bind=cmd.bind,
                    keys=keys,
                    group=group,
                    **cmd.session,  # type: ignore[arg-type]
                )
                reply = Reply(True, address=session.address)
            elif session is None or ref is None:
                reply = Reply(False, "send Setup first")
            elif isinstance(cmd, Expect):
                handles[cmd.rid] = session.expect(cmd.rid, cmd.sources, cmd.slots)
            elif isinstance(cmd, Offer):
                handles[cmd.rid] = session.offer(cmd.rid)
            elif isinstance(cmd, Write):
                send = handles[cmd.rid]
                assert isinstance(send, Send)
                send.write(cmd.slots, last=cmd.last)
            elif isinstance(cmd, Wait | Abort):
                h = handles[cmd.rid]
                try:
                    if isinstance(cmd, Abort):
                        h.abort(cmd.timeout)
                    else:
                        h.wait(cmd.timeout)
                except xk.XferError:
                    pass
                err, failing = h.error, h.failing
                reply = Reply(
                    True,
                    state=h.poll().name,
                    error="" if err is None else str(err),
                    stage="" if err is None else err.stage,
                    failing="" if failing is None else str(failing),
                )
            elif isinstance(cmd, Renew):
                session.renew(cmd.rid, cmd.sources)
            elif isinstance(cmd, Forget):
                handles.pop(cmd.rid, None)
            elif isinstance(cmd, Check):
                ref.check(index, cmd.slots)
            elif isinstance(cmd, Fill):
                for arr, rows in _cells(ref, index, cmd.slots):
                    arr[rows] = cmd.value
            elif isinstance(cmd, Verify):
                for arr, rows in _cells(ref, index, cmd.slots):
                    bad = np.flatnonzero((arr[rows] != cmd.value).reshape(rows.size, -1).any(1))
                    if bad.size:
                        raise AssertionError(f"slot {int(rows[bad[0]])} was written after reuse")
            elif isinstance(cmd, Stray):
                hit: set[int] = set()
                for arr, rows in _cells(ref, index, cmd.slots):
                    differ = (arr[rows] != cmd.value).reshape(rows.size, -1)  # uint8: bytes
                    reply.count += int(differ.sum())
                    reply.total += differ.size
                    hit.update(int(r) for r in rows[differ.any(1)])
                reply.error = " ".join(map(str, sorted(hit)))
            elif isinstance(cmd, Scrub):
                staging = session._staging  # the test's view of the Session's own buffer
                base = staging.addr
                gaps = list(session._protocol.s.arena._gaps)  # (address, length) held by none
                scrubbed = [slice(a - base, a - base + n) for a, n in gaps]
                for piece in scrubbed:
                    staging.buffer[piece] = cmd.value
                reply.count = sum(p.stop - p.start for p in scrubbed)
            elif isinstance(cmd, Stained):
                buffer = session._staging.buffer
                for piece in scrubbed:
                    differ = np.flatnonzero(buffer[piece] != cmd.value)
                    if differ.size and not reply.count:
                        reply.error = str(piece.start + int(differ[0]))
                    reply.count += int(differ.size)
                    reply.total += piece.stop - piece.start
            elif isinstance(cmd, Landed):
                want = ref.expected(index, cmd.slots)
                dst = {pool: pair[1] for pool, pair in cmd.slots.items()}
                for key, arr in ref.dsts[index].arrays.items():
                    if key[0] not in dst or not arr.size:
                        continue
                    rows = np.asarray(dst[key[0]], dtype=np.int64)
                    same = (arr[rows] == want[key][rows]).reshape(rows.size, -1).all(1)
                    reply.count += int(same.sum())
                    reply.total += rows.size
        except Exception as exc:
            reply = Reply(False, f"{type(exc).__name__}: {exc}")
        reply.elapsed = time.monotonic() - started
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
        sys.stdout.flush()
    if session is not None:
        session.close()


class RankProcess:
    """The test's handle on one rank process."""

    def __init__(self, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        """``prefix`` runs the rank elsewhere (``host.prefix()`` of ``xferkit.testing.hosts``)."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(Path(__file__))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._decoder = msgspec.json.Decoder(Reply)
        self.address = ""

    def send(self, command: Command) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(command).decode() + "\n")
        self.proc.stdin.flush()

    def reply(self) -> Reply:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank process {self.proc.pid} exited ({self.proc.wait()})")
        return self._decoder.decode(line)

    def ask(self, command: Command) -> Reply:
        self.send(command)
        return self.reply()

    def ok(self, command: Command) -> Reply:
        reply = self.ask(command)
        assert reply.ok, reply.error
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(Quit())
                self.proc.wait(timeout=15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


def past_handshake(dec: RankProcess, rid: str, within: float = 10.0) -> str:
    """``rid``'s state on ``dec`` once it is past its handshake (its Requests sent). A fixed
    wait instead reads HANDSHAKING whenever a loaded machine slows a pair's first connect."""
    deadline = time.monotonic() + within
    while (state := dec.ok(Wait(rid, 0.05)).state) == "HANDSHAKING":
        assert time.monotonic() < deadline, f"{rid} never got past its handshake"
    return state


def start(setups: list[Setup]) -> list[RankProcess]:
    """Start one process per setup (in parallel), set each up, return them with addresses."""
    procs = [RankProcess() for _ in setups]
    for p, s in zip(procs, setups, strict=True):
        p.send(s)
    for p in procs:
        reply = p.reply()
        assert reply.ok, reply.error
        p.address = reply.address
    return procs


@contextmanager
def ranks(*setups: Setup) -> Iterator[list[RankProcess]]:
    """``start`` as a context: every rank process closed on the way out."""
    procs = start(list(setups))
    try:
        yield procs
    finally:
        for p in procs:
            p.close()


if __name__ == "__main__":
    serve()
