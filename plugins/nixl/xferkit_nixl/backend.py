"""The NIXL driver: one ``nixl_agent`` per backend (UCX by default), host or GPU memory.

A thin adapter: each primitive is one or two NIXL calls, and every NIXL
exception leaves through one table (``nixl_api.ERRORS``) as an xferkit error.
NIXL holds one metadata per remote agent name: ``connect`` loads a peer's in
place of an older one, and it stays after the last disconnect (removing it
frees no socket until close). NIXL keeps a failed UCX endpoint until the
metadata is removed, so the first post after a failed request reloads it.

A fence (``fence``) registers the memory in a new agent, under a new name,
switches to it and destroys the old one, which closes the old agent's UCX
connections: a peer's write then lands only where UCX needs the receiving agent
to apply it (``ucx_env.fencing``: UCX_TLS=tcp, say), so only there is fencing
declared. Destroying the agent cuts every peer at once (``fence_cuts_all``).

Releasing a request in flight does not stop what UCX queued for it: over TCP every
put still goes out and lands (the whole of a 32 MiB write aborted 2 ms in). A
notification posted afterwards lands behind them, so the driver declares
``ends_are_final=False`` and the Session waits for that notification instead.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from xferkit.driver import (
    AddressTable,
    Capabilities,
    Descriptors,
    Done,
    Driver,
    DriverOptions,
    Manifest,
    OptionError,
    PluginError,
    Posted,
    ProtocolError,
    Region,
    Status,
    rdma_devices,
)

from . import sockets, ucx_env
from .memory import Kind, Kinds, gpu_visible, memory_kind, rows, split_by_kind
from .nixl_api import describe, error, load, new_agent

log = logging.getLogger("xferkit.nixl")

_names = itertools.count(1)


DESCRIPTOR_BYTES = 27_000
"""About 2 us per descriptor at 12 GB/s (benchmarks/bench_staging.py)."""
COPY_COST = 1.9
"""Its large copies run at 1.9x the local copier's strided pack (benchmarks/bench_staging.py)."""
FENCE_S = 15.0
"""How long a fence waits, once it has dropped the old agent, for its last references to go:
a call into it still running on another thread (the release of a request in flight, which
NIXL may drain for up to 10 s, ``NIXL_UCX_REQUEST_DRAIN_TIMEOUT``, among them)."""


class NixlOptions(DriverOptions, frozen=True):
    """What ``open_backend("nixl", ...)`` takes (docs/nixl.md says more)."""

    backends: Annotated[
        tuple[str, ...],
        msgspec.Meta(min_length=1, description="NIXL backend plugins the agent creates"),
    ] = ("UCX",)
    agent_prefix: Annotated[
        str, msgspec.Meta(min_length=1, description="the start of the agent's name")
    ] = "xferkit"
    max_batch: Annotated[
        int, msgspec.Meta(ge=0, description="descriptors per NIXL request; 0: no limit")
    ] = 0
    progress_thread: Annotated[
        bool, msgspec.Meta(description="NIXL's own progress thread drives UCX")
    ] = True
    progress_delay_us: Annotated[
        int, msgspec.Meta(ge=0, description="that thread's pause between rounds, in us")
    ] = 1000


class _Blob(msgspec.Struct, frozen=True):
    name: str
    metadata: bytes


class _Link:
    """A peer agent: its metadata, its regions' memory kinds, whether to (re)load it first."""

    __slots__ = ("kinds", "metadata", "name", "reload")

    def __init__(self, name: str, metadata: bytes, kinds: Kinds) -> None:
        self.name, self.metadata, self.kinds = name, metadata, kinds
        self.reload = True  # not loaded yet, replaced since, or a request to it failed


class _nixl:  # a class, not a generator: it runs several times per write
    """Around every NIXL call: NIXL's exception leaves as the xferkit error ``ERRORS`` names."""

    __slots__ = ("link", "what")

    def __init__(self, what: str, link: _Link | None = None) -> None:
        self.what, self.link = what, link

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception):
            if (link := self.link) is None:
                raise error(self.what, exc) from exc
            link.reload = True  # NIXL keeps a failed endpoint: reload before the next request
            raise error(f"{self.what} for agent {link.name}", exc, link.name) from exc


class _Xfer(Posted):
    """One posted batch: one NIXL request, or one per memory-kind pair when kinds mix."""

    __slots__ = (
        "_agent", "_error", "_handles", "_link", "_lock", "_notify", "_owner", "_pending",
        "_status",
    )  # fmt: skip

    def __init__(
        self, agent: Any, link: _Link, handles: list, states: list, notify: bytes | None,
        owner: set[_Xfer],
    ) -> None:  # fmt: skip
        self._agent, self._link, self._handles = agent, link, handles
        self._owner = owner  # the batches not yet released of its agent (a fence cuts them)
        self._pending = [h for h, st in zip(handles, states, strict=True) if st != "DONE"]
        self._notify = notify  # sent with send_notif once every request is done
        self._status, self._error = Status.PENDING, ""
        self._lock = threading.Lock()  # wait() polls in one thread, close() releases in another
        if "ERR" in states:
            self._fail("transfer() returned ERR")

    def _fail(self, text: str) -> None:
        self._link.reload = True
        self._status, self._error = Status.FAILED, f"NIXL request to {self._link.name}: {text}"

    def poll(self) -> Status:
        with self._lock:
            if self._status is Status.PENDING:  # not once released: no call into a freed handle
                self._progress()
            return self._status

    def _progress(self) -> None:
        try:
            while self._pending:
                with _nixl("check_xfer_state"):
                    state = self._agent.check_xfer_state(self._pending[-1])
                if state == "PROC":
                    return
                if state != "DONE":
                    return self._fail(f"check_xfer_state returned {state}")
                self._pending.pop()
            if self._notify is not None:
                with _nixl("data written, but send_notif"):
                    self._agent.send_notif(self._link.name, self._notify)
        except Exception as exc:
            return self._fail(str(exc))
        self._status = Status.DONE

    @property
    def error(self) -> str:
        return self._error

    def block(self, timeout: float) -> None:
        # No blocking wait in NIXL: spin 100 us, then nap 50 us between polls (spare the core).
        start = time.perf_counter()
        while self.poll() is Status.PENDING:
            now = time.perf_counter()
            if now - start >= timeout:
                return
            time.sleep(0 if now - start < 1e-4 else min(5e-5, start + timeout - now))

    def release(self) -> None:
        """Free NIXL's handles; NIXL cancels a request in flight (draining it up to 10 s)."""
        self._owner.discard(self)
        with self._lock:
            handles, self._handles, self._pending = self._handles, [], []
            if self._status is Status.PENDING:
                self._status, self._error = Status.FAILED, "released before it completed"
        if failed := _release(handles):
            with _nixl("release_xfer_handle"):
                raise failed[0]

    def cut(self, why: str) -> list[Exception]:
        """Its agent is about to be destroyed (a fence): free NIXL's handles now, FAILED unless
        it ended, and never call into that agent again. Returns what the releases raised."""
        with self._lock:
            handles, self._handles, self._pending = self._handles, [], []
            self._agent = None  # poll() answers from the status from now on
            if self._status is Status.PENDING:
                self._fail(why)
        return _release(handles)


def _release(handles: list) -> list[Exception]:
    """Release every handle, whichever raises (an ExitStack costs 1.5 us per write)."""
    failed: list[Exception] = []
    for h in handles:
        try:
            h.release()
        except Exception as exc:
            failed.append(exc)
    return failed


class NixlDriver(Driver):
    """xferkit over one NIXL agent, whose name is the ``address``. Options: ``NixlOptions``."""

    name: ClassVar[str] = "nixl"
    Blob: ClassVar[type[msgspec.Struct]] = _Blob
    Options: ClassVar[type[DriverOptions]] = NixlOptions

    def __init__(self, options: NixlOptions | None = None) -> None:
        self._opts = opts = options if options is not None else NixlOptions()
        self.env_notes = ucx_env.apply_defaults()  # before the first agent of the process
        self._api, self._bindings = load()
        self._segments = {"DRAM": self._bindings.DRAM_SEG, "VRAM": self._bindings.VRAM_SEG}
        # UCX reads UCX_TLS at each agent's creation: a fence's new agent must see this one.
        self._tls = os.environ.get("UCX_TLS")
        fences, self.fence_note = ucx_env.fencing(self._tls, rdma_devices(), gpu_visible())
        if fences and tuple(opts.backends) != ("UCX",):
            fences, self.fence_note = False, (
                f"backends {list(opts.backends)}: a fence is shown for the UCX backend alone"
            )  # fmt: skip
        log.debug("nixl: fencing %s: %s", "declared" if fences else "not declared", self.fence_note)
        self._fences = fences
        self.address, self._agent, self._sockets = self._start_agent()
        vram = all("VRAM_SEG" in self._agent.get_backend_mem_types(b) for b in opts.backends)
        self.capabilities = Capabilities(
            memory=frozenset({"cpu", "cuda"} if vram and gpu_visible() else {"cpu"}),
            notifications=True,
            cross_process=True,
            max_batch=opts.max_batch,
            descriptor_bytes=DESCRIPTOR_BYTES,
            copy_cost=COPY_COST,
            fencing=fences,
            fence_cuts_all=fences,
            ends_are_final=False,  # on every transport: cma alone would stop, and is rarely alone
        )
        self._regs: dict[tuple[int, int, str], Any] = {}  # (addr, nbytes, device) -> NIXL's
        self._here: Kinds | None = None  # the registered regions' kinds, built when needed
        self._remotes: dict[str, _Link] = {}  # agent name -> the link whose metadata NIXL holds
        self._xfers: set[_Xfer] = set()  # the current agent's batches not yet released
        # Held while a post picks its agent (and loads a peer's metadata into it), and while a
        # fence switches agents: a batch is registered with the agent it was posted on.
        self._lock = threading.Lock()

    def _start_agent(self) -> tuple[str, Any, sockets.Owned | None]:
        """A new agent under a new name (the prefix, the pid, a count, random hex digits), and,
        where a fence may come, the sockets it opened (``sockets``: silenced when it is fenced)."""
        opts = self._opts
        name = f"{opts.agent_prefix}-{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:8]}"
        config = self._api.nixl_agent_config(
            enable_prog_thread=opts.progress_thread,
            enable_listen_thread=False,
            backends=list(opts.backends),
        )
        with sockets.creating if self._fences else contextlib.nullcontext():
            before = sockets.snapshot() if self._fences else {}
            try:
                agent = new_agent(self._api, self._bindings, name, config, opts.progress_delay_us)
            except Exception as exc:
                raise PluginError(f"nixl: creating agent {name}: {describe(exc)}") from exc
            after = sockets.snapshot() if self._fences else {}
        if missing := [b for b in opts.backends if b not in agent.backends]:
            plugins, agent = agent.get_plugin_list(), None  # released now
            raise OptionError(
                f"nixl: agent {name} could not create backend(s) {missing}; "
                f"NIXL plugins here: {plugins}"
            )
        if not self._fences:
            return name, agent, None
        with _nixl(f"nixl: get_agent_metadata of the new agent {name}"):
            metadata = agent.get_agent_metadata()
        return name, agent, sockets.owned(before, after, metadata)

    # -- memory ------------------------------------------------------------------

    def register_region(self, region: Region) -> None:
        kind, dev = memory_kind(region.device)
        with _nixl(f"register_memory({kind}, device {dev})"):
            reg = self._agent.register_memory([(region.addr, region.nbytes, dev, "")], kind)
        self._regs[(region.addr, region.nbytes, region.device)] = reg
        self._here = None

    def deregister_region(self, region: Region) -> None:
        reg = self._regs.pop((region.addr, region.nbytes, region.device))  # the core's to know
        self._here = None
        with _nixl("deregister_memory"):
            self._agent.deregister_memory(reg)

    def _local(self) -> Kinds:
        if self._here is None:
            addrs, nbytes, devices = zip(*self._regs, strict=True)
            self._here = Kinds.of(devices, AddressTable(np.array(addrs), np.array(nbytes)).locate)
        return self._here

    # -- peers -------------------------------------------------------------------

    def endpoint(self) -> _Blob:
        with self._lock:
            name, agent = self.address, self._agent
        with _nixl("nixl: get_agent_metadata"):
            return _Blob(name, agent.get_agent_metadata())

    def connect(self, blob: Any, manifest: Manifest) -> _Link:
        kinds = Kinds.of([r.device for r in manifest.regions], manifest.locate)
        link = _Link(blob.name, blob.metadata, kinds)
        with self._lock:
            self._load(link)
        return link

    def _load(self, link: _Link) -> None:
        """Make ``link``'s metadata the one this agent holds under its name (NIXL holds one).
        Called with ``_lock`` held: a fence does not switch agents meanwhile."""
        held = self._remotes.get(link.name)
        current = held is not None and not held.reload and held.metadata == link.metadata
        if not current and link.name != self.address:  # an agent reaches itself as it is
            if held is not None:  # NIXL refuses new metadata under a name it holds
                held.reload = True
                del self._remotes[link.name]
                with _nixl("nixl: dropping old metadata (remove_remote_agent)", link):
                    self._agent.remove_remote_agent(link.name)
            with _nixl("nixl: loading metadata (add_remote_agent)", link):
                loaded = self._agent.add_remote_agent(link.metadata)
            if loaded not in (link.name, link.name.encode()):  # NIXL answers bytes
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(loaded)
                why = f"the endpoint names agent {link.name} but holds the metadata of {loaded!r}"
                raise ProtocolError(f"nixl: {why}", subject=link.name)
        link.reload = False
        self._remotes[link.name] = link

    # disconnect: the base no-op. The metadata stays loaded (removing it frees no socket).

    # -- transfers -----------------------------------------------------------------

    def post(self, link: Any, descs: Descriptors, notify: bytes | None) -> Posted:
        groups = split_by_kind(self._local(), link.kinds, descs)
        # The notification rides on the one request; with several (memory kinds mixed), or
        # when it is empty (NIXL drops an empty notif_msg), it follows them with send_notif.
        after = notify if notify is not None and (len(groups) > 1 or not notify) else None
        riding = b"" if after is not None or notify is None else notify
        with self._lock:
            agent, live = self._agent, self._xfers
            if link.reload:
                self._load(link)
        handles: list = []
        states: list[str] = []
        try:
            for lkind, rkind, part in groups:
                handles.append(self._request(link, lkind, rkind, part, riding, agent))
                with _nixl("transfer()", link):
                    states.append(agent.transfer(handles[-1]))
        except Exception:
            for h in handles:
                with contextlib.suppress(Exception):  # the first failure is the one reported
                    h.release()
            raise
        xfer = _Xfer(agent, link, handles, states, after, live)
        with self._lock:
            current = live is self._xfers
            if current:
                live.add(xfer)
        if not current:  # a fence switched agents while this was posted on the old one
            xfer.cut("this agent was fenced while the batch was posted")
        return xfer

    def _request(
        self, link: _Link, lkind: Kind, rkind: Kind, d: Descriptors, notify: bytes,
        agent: Any = None,
    ) -> Any:  # fmt: skip
        """A NIXL request (not yet posted) writing ``d`` to the peer, made by ``agent`` (the
        one ``post`` picked; None: the current one)."""
        b = self._bindings
        agent = self._agent if agent is None else agent
        with _nixl("initialize_xfer(WRITE)", link):
            return agent.initialize_xfer(
                "WRITE",
                b.nixlXferDList(self._segments[lkind[0]], rows(d.src, d.nbytes, lkind[1])),
                b.nixlXferDList(self._segments[rkind[0]], rows(d.dst, d.nbytes, rkind[1])),
                link.name,
                notify,
            )

    def notify(self, link: Any, message: bytes) -> Posted:
        with self._lock:
            agent = self._agent
            if link.reload:
                self._load(link)
        with _nixl("send_notif", link):
            agent.send_notif(link.name, message)
        return Done()

    def notifications(self) -> list[tuple[str, bytes]]:
        agent = self._agent  # those the old agent held when a fence destroyed it are lost
        with _nixl("nixl: get_new_notifs"):
            notes = agent.get_new_notifs()
        return [(str(peer), bytes(m)) for peer, msgs in notes.items() for m in msgs]

    # -- fencing -------------------------------------------------------------------

    def fence(self, source: str) -> None:
        """Cut every peer off, ``source`` among them: the old agent's sockets are silenced, the
        memory is registered in a new agent under a new name, the driver switches to it, and
        the old agent is destroyed, which closes its UCX connections (declared only where that
        stops every write: ``ucx_env.fencing``). Its batches not yet released are released
        first (FAILED). Raises where it cannot be done: before the switch with everything as
        it was, after it (the old agent still referenced) with the new agent in place."""
        started = time.monotonic()
        what = f"nixl: fencing {source}"
        if (tls := os.environ.get("UCX_TLS")) != self._tls:
            raise PluginError(
                f"{what}: UCX_TLS is {tls!r} now but was {self._tls!r} when this backend "
                "opened, so a new agent would not use the transports a fence was declared for"
            )
        with self._lock:
            regs, old_sockets = dict(self._regs), self._sockets
        # The old agent hears nothing from now on (``sockets``: a filter on its sockets drops
        # every packet): no stream goes on while the new agent starts, nor holds its
        # destruction up. Undone if the new agent cannot take over.
        silenced = sockets.silence(old_sockets) if old_sockets is not None else []
        agent: Any = None
        fresh: dict[tuple[int, int, str], Any] = {}
        try:
            name, agent, owned = self._start_agent()
            for addr, nbytes, device in regs:
                kind, dev = memory_kind(device)
                with _nixl(f"{what}: register_memory({kind}, device {dev}) in new agent {name}"):
                    fresh[(addr, nbytes, device)] = agent.register_memory(
                        [(addr, nbytes, dev, "")], kind
                    )
            with self._lock:
                if self._regs.keys() != regs.keys():
                    raise PluginError(f"{what}: memory was registered or deregistered meanwhile")
                old, old_name, live = self._agent, self.address, self._xfers
                self._agent, self.address, self._xfers, self._regs = agent, name, set(), fresh
                self._sockets = owned
                for link in self._remotes.values():  # the new agent holds no peer's metadata
                    link.reload = True
                self._remotes = {}
        except BaseException:
            agent = None  # the new agent and its registrations go now, not with the error
            fresh.clear()
            sockets.unsilence(silenced)  # the old agent serves on; TCP resends what it dropped
            raise
        del agent, regs
        # The C++ agent goes when its bindings object does (every request handle holds it).
        gone = weakref.ref(getattr(old, "agent", old))
        why = f"its agent {old_name} was destroyed to fence {source}"
        cut = len(live)
        failed = [exc for xfer in list(live) for exc in xfer.cut(why)]
        if failed:
            log.warning("%s: releasing %d request(s) raised %s", what, len(failed), failed[0])
        del old, live, failed
        dropped, collected = time.monotonic(), False
        while gone() is not None:  # a call into it on another thread still holds it
            waited = time.monotonic() - dropped
            if waited >= FENCE_S:
                raise PluginError(
                    f"{what}: agent {old_name} is still referenced {FENCE_S:.0f} s on (a call "
                    "into it has not returned), so it is not destroyed: not fenced"
                )
            if not collected and waited >= 0.05:
                gc.collect()  # held in a reference cycle, rather than by a call still running
                collected = True
            time.sleep(0.001)
        done = time.monotonic()
        log.info(
            "%s: agent %s destroyed with %d batch(es) of ours cut and %d socket(s) silenced "
            "in %.0f ms; %s from now",
            what, old_name, cut, len(silenced), 1000 * (done - started), name,
        )  # fmt: skip

    def close(self) -> None:
        self._agent = None  # the agent, its UCX workers and remote metadata go with the last ref


__all__ = ["NixlDriver"]
