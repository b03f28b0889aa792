"""One Session per rank: the engine-facing facade over the protocol core and its shell.

Engine calls validate their arguments here, queue a command for the control thread and
return: only ``wait`` and ``abort`` on a handle block, and only when asked to. The control
thread (``shell``) runs the protocol core (``protocol``), which decides everything; driver
calls run on the data-plane worker (``dataplane``). See docs/engine.md and docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..arguments import seconds
from ..backend import Backend
from ..closing import Closing
from ..copier import CPU
from ..errors import ArgumentError, XferError
from ..manifest import Manifest
from ..reach import check_reach
from . import checks
from .checks import utf8
from .config import SessionConfig, open_session
from .core import DRAIN_S, REMEMBERED, Settings, log
from .handles import Receive, Send
from .keys import SessionKeys
from .prefix import check_skip
from .protocol import Protocol
from .roster import GROUP
from .rounds import Staging, copier_of
from .shell import Shell
from .sockets import check
from .states import PairEvent

__all__ = ["GROUP", "Session", "fingerprint"]

_D = SessionConfig()  # the defaults, stated once (a config file and a caller agree)


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


def _abandoned(shell: Shell, backend: Backend, address: str) -> None:
    """A Session was garbage-collected unclosed: stop its threads, release its backend."""
    warnings.warn(
        f"xferkit Session {address} was never closed: closing it now", ResourceWarning, stacklevel=1
    )
    _stop(shell, backend, f"session {address} was dropped without close()", 10.0)


def _stop(shell: Shell, backend: Backend, why: str, timeout: float) -> None:
    shell.submit(("close", why, max(timeout - 1.0, 0.0)))  # drains, leaving time to tear down
    here = shell.on_control_thread()  # close() from an engine's hook: it cannot join itself
    if (here or not shell.join(timeout)) and shell.hand_over():
        if not here:
            log.warning("%s: the control thread did not stop within %s s; it releases the "
                        "sockets as it ends", shell.where, timeout)  # fmt: skip
    else:
        shell.teardown()
    backend.close()  # deregistered: nothing lands after close() returns, whatever the thread


class Session(Closing):
    """One rank's transfer session. See docs/engine.md.

    It owns ``backend`` (registering ``manifest`` if nothing is registered yet)
    and closes it on ``close``; a Session dropped without ``close`` is closed by
    the garbage collector, with a ``ResourceWarning``.
    """

    def __init__(
        self,
        backend: Backend,
        manifest: Manifest,
        *,
        bind: str = _D.bind,
        keys: SessionKeys | None = None,
        heartbeat_s: float = _D.heartbeat_s,
        dead_after_s: float = _D.dead_after_s,
        handshake_timeout_s: float = _D.handshake_timeout_s,
        request_timeout_s: float = _D.request_timeout_s,
        lease_s: float = _D.lease_s,
        reconnect_min_s: float = _D.reconnect_min_s,
        reconnect_max_s: float = _D.reconnect_max_s,
        group: str | None = _D.group,
        pp_rank: int = _D.pp_rank,
        pp_size: int = _D.pp_size,
        staging: str = _D.staging,
        staging_bytes: int = _D.staging_bytes,
        staging_slice_bytes: int = _D.staging_slice_bytes,
        on_finished: Callable[[Receive | Send], None] | None = None,
        on_pair: Callable[[PairEvent], None] | None = None,
    ) -> None:
        if not isinstance(backend, Backend):
            raise XferError(f"Session needs a xferkit.Backend, not {backend!r}")
        for name, hook in (("on_finished", on_finished), ("on_pair", on_pair)):
            if hook is not None and not callable(hook):
                raise XferError(f"{name} must be callable (one argument -> None), not {hook!r}")
        self._on_finished = on_finished
        if not isinstance(manifest, Manifest):
            raise XferError(f"Session needs a Manifest, not {manifest!r}")
        if keys is not None and not isinstance(keys, SessionKeys):
            raise XferError(f"keys must be SessionKeys or None, not {keys!r}")
        if not isinstance(bind, str) or not bind.startswith(("tcp://", "ipc://")) or not utf8(bind):
            raise XferError(f"bind must be a tcp:// or ipc:// address, not {bind!r}")
        check_reach(backend, bind)  # before anything is registered or bound
        if group is not None and (not isinstance(group, str) or not group or not utf8(group)):
            raise XferError(f"group is the session address of the rank serving it, not {group!r}")
        if group is not None and (problem := check(group.removeprefix(GROUP), keys)) is not None:
            raise XferError(f"Session cannot join group {group!r}: {problem}")
        for name, value in (("pp_size", pp_size), ("pp_rank", pp_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise XferError(f"{name} must be a non-negative int, not {value!r}")
        if not 0 <= pp_rank < pp_size:
            raise XferError(f"pp_rank {pp_rank} is not a stage of pp_size {pp_size}")
        self.heartbeat_s = seconds(heartbeat_s, "heartbeat_s")
        self.dead_after_s = seconds(dead_after_s, "dead_after_s")
        self.handshake_timeout_s = seconds(handshake_timeout_s, "handshake_timeout_s")
        self.request_timeout_s = seconds(request_timeout_s, "request_timeout_s")
        self.lease_s = seconds(lease_s, "lease_s")
        self.reconnect_min_s = seconds(reconnect_min_s, "reconnect_min_s")
        self.reconnect_max_s = seconds(reconnect_max_s, "reconnect_max_s")
        if self.dead_after_s <= self.heartbeat_s:
            raise XferError(
                f"dead_after_s ({dead_after_s}) must exceed heartbeat_s ({heartbeat_s})"
            )
        if self.reconnect_max_s < self.reconnect_min_s:
            raise XferError(
                f"reconnect_max_s ({reconnect_max_s}) is below reconnect_min_s ({reconnect_min_s})"
            )
        if not isinstance(staging, str) or staging not in ("auto", "always", "never"):
            raise XferError(f"staging must be 'auto', 'always' or 'never', not {staging!r}")
        for name, value in (
            ("staging_bytes", staging_bytes),
            ("staging_slice_bytes", staging_slice_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise XferError(f"{name} must be a non-negative int, not {value!r}")
        if staging != "never" and not 0 < staging_slice_bytes <= staging_bytes:
            raise XferError(
                f"staging_slice_bytes ({staging_slice_bytes}) must be within 1..staging_bytes "
                f"({staging_bytes}); pass staging='never' to stage nothing"
            )
        copier = copier_of(manifest) if staging != "never" else None
        if copier is None:  # nothing to copy with (mixed devices, no torch): direct only
            staging = "never"
        self._copier = copier or CPU  # copies nothing while staging is off
        self._staging = Staging(
            manifest, staging_bytes if staging != "never" else 0, self._copier.device
        )
        registered = self._staging.manifest
        fresh = backend.manifest is None  # registered once bound: a refused bind leaves it so
        if not fresh and backend.manifest != manifest:
            raise XferError("the backend has another manifest registered than the one given")
        if not fresh:  # registered by the engine: no room for staging
            if staging != "never":
                log.warning("%s: the backend was registered already: staging is off", bind)
            staging, registered = "never", manifest
            self._staging = Staging(manifest, 0)
        self.staging = staging
        self.backend = backend
        self.manifest = registered
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.keys = keys
        reconnect = (self.reconnect_min_s, self.reconnect_max_s)
        # the engine's hook itself: a bound method of this Session would keep it alive
        shell = self._shell = Shell(backend, bind, keys, reconnect, self._copier, on_pair)
        where = shell.where
        if fresh:
            try:
                backend.register(registered)
            except BaseException:
                shell.teardown()
                raise
        self.address: str = where if keys is None else f"{where}|{keys.public.decode()}"
        """The string a peer passes to ``expect(source=...)``."""
        caps = backend.capabilities
        settings = Settings(
            address=self.address,
            incarnation=random.getrandbits(63),
            manifest=registered,
            pp_rank=pp_rank,
            pp_size=pp_size,
            backend=backend.name,
            driver_name=f"{backend.name}:{backend.driver.address}",
            endpoint=backend.endpoint(),
            fingerprint=fingerprint(manifest),
            notifying=caps.notifications,
            pokes=caps.notifications and backend.notification_fd() is None,
            fencing=caps.fencing,
            fence_cuts_all=caps.fence_cuts_all,
            ends_are_final=caps.ends_are_final,
            descriptor_bytes=caps.descriptor_bytes,
            copy_cost=caps.copy_cost,
            staging=staging,
            arena=self._staging.arena(staging_slice_bytes),
            copier=copier,
            runner=shell.packer.run,
            clock=time.monotonic,
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
            handshake_timeout_s=self.handshake_timeout_s,
            request_timeout_s=self.request_timeout_s,
            lease_s=self.lease_s,
            reconnect_min_s=self.reconnect_min_s,
            reconnect_max_s=self.reconnect_max_s,
            # A write of ours is posted with the request's time left and must leave the driver
            # within DRAIN_S of an abort: no byte of it lands later than this after an abort.
            drain_s=min(self.request_timeout_s + DRAIN_S, 3600.0),
        )
        self.incarnation = settings.incarnation
        self._known_pools = frozenset(manifest.pools) | {k[0] for k in manifest.dropped_keys}
        self._lock = threading.Lock()
        self._used: OrderedDict[str, None] = OrderedDict()  # ids given to expect/offer
        self._closed = False
        self._protocol = Protocol(settings, group=group)
        shell.start(self._protocol, caps.notifications)
        self._finalizer = weakref.finalize(self, _abandoned, shell, backend, self.address)
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return f"Session({self.address!r}, rank {self.manifest.tp_rank}/{self.manifest.tp_size})"

    @property
    def group_address(self) -> str:
        """The address through which a decode rank reaches this rank's whole group (every rank
        that joined it with ``group=``): pass it as ``expect(source=...)``."""
        return GROUP + self.address

    # -- engine calls ----------------------------------------------------------------

    def expect(
        self, request_id: str, source: str | Iterable[str], slots: Mapping[str, Any],
        skip: Mapping[str, int] | None = None,
    ) -> Receive:  # fmt: skip
        """Decode side: receive ``request_id`` into ``slots[pool]`` from the source ranks: every
        session address in ``source``, every rank of a group address (``group_address``); the
        plans pick the ones needed. ``skip[pool]``: the request's first slots of ``pool`` this
        rank holds already (a prefix cache hit; ``slots`` names the rest): the sources' pages
        that would fill them are not sent (docs/engine.md, "Prefix delta")."""
        self._check_open("expect")
        rid = checks.request_id(request_id)
        sources = checks.sources(source, "expect")
        checked = self._local_slots(slots, f"request {rid!r}: expect()")
        held = check_skip(skip, checked, f"request {rid!r}: expect()")
        self._claim(rid)
        handle = Receive(self, rid)
        self._submit(("expect", handle, rid, sources, checked, self.backend.generation, held))
        return handle

    def offer(self, request_id: str) -> Send:
        """Prefill side: the request ``request_id`` will be written from here (``Send.write``)."""
        self._check_open("offer")
        rid = checks.request_id(request_id)
        self._claim(rid)
        handle = Send(self, rid)
        self._submit(("offer", handle, rid))
        return handle

    def renew(self, request_id: str, source: str | Iterable[str]) -> None:
        """Decode side, before ``expect``: ask the sources to keep holding ``request_id`` (written,
        not yet claimed) for another ``lease_s`` of theirs. A source holding nothing ignores it."""
        self._check_open("renew")
        rid = checks.request_id(request_id)
        self._submit(("renew", rid, checks.sources(source, "renew")))

    @classmethod
    def from_config(
        cls, manifest: Manifest, config: Mapping[str, Any] | str | None = None, **options: Any
    ) -> Session:
        """A Session from a mapping or a JSON/TOML file, with ``XFERKIT_*`` variables over
        it; ``options``: ``env``, ``backend``, ``on_finished``, ``on_pair``
        (``xferkit.session.config.open_session``)."""
        unknown = set(options) - {"env", "backend", "on_finished", "on_pair"}
        if unknown:
            raise ArgumentError(f"from_config(): no option {sorted(unknown)}", subject=manifest)
        return open_session(cls, manifest, config, **options)

    @property
    def staging_in_use(self) -> int:
        """Bytes of this Session's staging its requests hold now (of ``staging_size``): a
        moment's view, readable from any thread (what ``Metrics.watch`` exports)."""
        return self._protocol.s.arena.used

    @property
    def staging_size(self) -> int:
        """Bytes of staging this Session hands out (0 with ``staging="never"``)."""
        return self._protocol.s.arena.size

    def progress(self) -> list[str]:
        """The request ids that finished (DONE or FAILED) since the last call."""
        shell = self._shell
        with shell.lock:
            out, shell.progress = shell.progress, []
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Fail every open request on both sides, tell the peers, release sockets and backend."""
        limit = seconds(timeout, "timeout")  # refused before anything stops: nothing leaks
        with self._lock:  # a command is queued before the close, or refused (``_submit``)
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        _stop(self._shell, self.backend, f"session {self.address} was closed", limit)

    def _finished(self, handle: Receive | Send) -> None:
        """A request ended: the engine's hook (``on_finished``) sees its handle, on the control
        thread; a hook that raises is logged, never lets the Session down."""
        _call(self._on_finished, handle, self.address)

    def _submit(self, command: tuple[Any, ...]) -> None:
        """Queue ``command`` ahead of any close, or refuse it: one queued behind the close
        was never run, and its handle stayed HANDSHAKING for good."""
        with self._lock:
            self._check_open(command[0])
            if not self._shell.submit(command):
                ended = f"session {self.address}'s control thread has ended (see the log)"
                raise XferError(f"{command[0]}(): {ended}")

    # -- checks on the engine's thread -----------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise XferError(f"{call}(): session {self.address} is closed")

    def _claim(self, rid: str) -> None:
        with self._lock:
            if rid in self._used:
                raise XferError(
                    f"request id {rid!r} was already used on this session: ids are single-use",
                    subject=rid,
                )
            self._used[rid] = None
            while len(self._used) > REMEMBERED:
                self._used.popitem(last=False)

    def _local_slots(self, slots: object, what: str) -> dict[str, np.ndarray]:
        """Slot indices per pool, checked against this rank's manifest."""
        if not isinstance(slots, Mapping) or not slots:
            raise XferError(f"{what}: slots map pool -> slot indices, not {slots!r}")
        pools = self.manifest.pools
        known = self._known_pools
        out: dict[str, np.ndarray] = {}
        for pool, raw in slots.items():
            if pool not in known:
                raise XferError(f"{what}: unknown pool {pool!r}; this rank has {sorted(known)}")
            try:
                arr = np.asarray(raw)
            except Exception:
                arr = np.zeros((0, 0))
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise XferError(f"{what}: pool {pool!r}: slot indices must be 1-D integers")
            arr = arr.astype(np.int64)  # a copy: the engine may reuse its own
            count = pools.get(pool)
            if arr.size > 1:  # one sort answers range and repeats (a page: no numpy at all)
                ordered = np.sort(arr)
                lo, hi = int(ordered[0]), int(ordered[-1])
                twice = bool((ordered[1:] == ordered[:-1]).any())
            else:
                lo = hi = int(arr[0]) if arr.size else 0
                twice = False
            if lo < 0 or (count is not None and arr.size and hi >= count):
                raise XferError(f"{what}: pool {pool!r}: a slot is out of range [0, {count})")
            if twice:
                raise XferError(f"{what}: pool {pool!r}: a slot is named twice")
            out[pool] = arr
        return out


def _call(hook: Callable[[Any], None] | None, arg: object, where: str) -> None:
    """Run an engine's hook; one that raises is logged, never lets the Session down."""
    if hook is not None:
        try:
            hook(arg)
        except Exception:
            log.exception("%s: the hook %r raised on %r", where, hook, arg)
