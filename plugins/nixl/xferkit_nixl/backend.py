"""The NIXL driver: one ``nixl_agent`` per backend (UCX by default), host or GPU memory.

A thin adapter: each primitive is one or two NIXL calls, and every NIXL
exception leaves through one table (``nixl_api.ERRORS``) as an xferkit error.
NIXL holds one metadata per remote agent name: ``connect`` loads a peer's in
place of an older one, and it stays after the last disconnect (removing it
frees no socket until close). NIXL keeps a failed UCX endpoint until the
metadata is removed, so the first post after a failed request reloads it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import uuid
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
)

from . import ucx_env
from .memory import Kind, Kinds, gpu_visible, memory_kind, rows, split_by_kind
from .nixl_api import describe, error, load, new_agent

_names = itertools.count(1)


DESCRIPTOR_BYTES = 27_000
"""About 2 us per descriptor at 12 GB/s (benchmarks/bench_staging.py)."""
COPY_COST = 1.9
"""Its large copies run at 1.9x the local copier's strided pack (benchmarks/bench_staging.py)."""


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

    __slots__ = ("_agent", "_error", "_handles", "_link", "_lock", "_notify", "_pending", "_status")

    def __init__(self, agent: Any, link: _Link, handles: list, states: list, notify: bytes | None):
        self._agent, self._link, self._handles = agent, link, handles
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
        with self._lock:
            handles, self._handles, self._pending = self._handles, [], []
            if self._status is Status.PENDING:
                self._status, self._error = Status.FAILED, "released before it completed"
        failed: list[Exception] = []
        for h in handles:  # every one, whichever raises (an ExitStack costs 1.5 us per write)
            try:
                h.release()
            except Exception as exc:
                failed.append(exc)
        if failed:
            with _nixl("release_xfer_handle"):
                raise failed[0]


class NixlDriver(Driver):
    """xferkit over one NIXL agent, whose name is the ``address``. Options: ``NixlOptions``."""

    name: ClassVar[str] = "nixl"
    Blob: ClassVar[type[msgspec.Struct]] = _Blob
    Options: ClassVar[type[DriverOptions]] = NixlOptions

    def __init__(self, options: NixlOptions | None = None) -> None:
        opts = options if options is not None else NixlOptions()
        agent_prefix, progress_thread = opts.agent_prefix, opts.progress_thread
        progress_delay_us = opts.progress_delay_us
        caps = Capabilities(
            notifications=True,
            cross_process=True,
            max_batch=opts.max_batch,
            descriptor_bytes=DESCRIPTOR_BYTES,
            copy_cost=COPY_COST,
        )
        self.env_notes = ucx_env.apply_defaults()  # before the first agent of the process
        api, self._bindings = load()
        self._segments = {"DRAM": self._bindings.DRAM_SEG, "VRAM": self._bindings.VRAM_SEG}
        self.address = f"{agent_prefix}-{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=list(opts.backends),
        )
        try:
            self._agent = new_agent(api, self._bindings, self.address, config, progress_delay_us)
        except Exception as exc:
            raise PluginError(f"nixl: creating agent {self.address}: {describe(exc)}") from exc
        if missing := [b for b in opts.backends if b not in self._agent.backends]:
            plugins, self._agent = self._agent.get_plugin_list(), None  # released now
            raise OptionError(
                f"nixl: agent {self.address} could not create backend(s) {missing}; "
                f"NIXL plugins here: {plugins}"
            )
        vram = all("VRAM_SEG" in self._agent.get_backend_mem_types(b) for b in opts.backends)
        memory = {"cpu", "cuda"} if vram and gpu_visible() else {"cpu"}
        self.capabilities = msgspec.structs.replace(caps, memory=frozenset(memory))
        self._regs: dict[tuple[int, int, str], Any] = {}  # (addr, nbytes, device) -> NIXL's
        self._here: Kinds | None = None  # the registered regions' kinds, built when needed
        self._remotes: dict[str, _Link] = {}  # agent name -> the link whose metadata NIXL holds

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
        with _nixl("nixl: get_agent_metadata"):
            return _Blob(self.address, self._agent.get_agent_metadata())

    def connect(self, blob: Any, manifest: Manifest) -> _Link:
        kinds = Kinds.of([r.device for r in manifest.regions], manifest.locate)
        link = _Link(blob.name, blob.metadata, kinds)
        self._load(link)
        return link

    def _load(self, link: _Link) -> None:
        """Make ``link``'s metadata the one this agent holds under its name (NIXL holds one)."""
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
        if link.reload:
            self._load(link)
        handles: list = []
        states: list[str] = []
        try:
            for lkind, rkind, part in groups:
                handles.append(self._request(link, lkind, rkind, part, riding))
                with _nixl("transfer()", link):
                    states.append(self._agent.transfer(handles[-1]))
        except Exception:
            for h in handles:
                with contextlib.suppress(Exception):  # the first failure is the one reported
                    h.release()
            raise
        return _Xfer(self._agent, link, handles, states, after)

    def _request(self, link: _Link, lkind: Kind, rkind: Kind, d: Descriptors, notify: bytes):
        """A NIXL request (not yet posted) writing ``d`` to the peer."""
        b = self._bindings
        with _nixl("initialize_xfer(WRITE)", link):
            return self._agent.initialize_xfer(
                "WRITE",
                b.nixlXferDList(self._segments[lkind[0]], rows(d.src, d.nbytes, lkind[1])),
                b.nixlXferDList(self._segments[rkind[0]], rows(d.dst, d.nbytes, rkind[1])),
                link.name,
                notify,
            )

    def notify(self, link: Any, message: bytes) -> Posted:
        if link.reload:
            self._load(link)
        with _nixl("send_notif", link):
            self._agent.send_notif(link.name, message)
        return Done()

    def notifications(self) -> list[tuple[str, bytes]]:
        with _nixl("nixl: get_new_notifs"):
            notes = self._agent.get_new_notifs()
        return [(str(peer), bytes(m)) for peer, msgs in notes.items() for m in msgs]

    def close(self) -> None:
        self._agent = None  # the agent, its UCX workers and remote metadata go with the last ref


__all__ = ["NixlDriver"]
