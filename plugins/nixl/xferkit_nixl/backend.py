"""The NIXL backend: one ``nixl_agent`` per backend, UCX by default, host or GPU memory.

* Registration: one ``register_memory`` call per region (DRAM for cpu, VRAM
  with the device id for cuda:N), so a failure names its region and the core
  can roll back exactly the ones that succeeded.
* Endpoint: the agent's name and ``get_agent_metadata()``, taken when asked
  (so after ``register``); a peer loads it with ``add_remote_agent``, first
  removing what it held under that name when the metadata changed (a restarted
  peer, or one that registered anew).
* Posting: ``initialize_xfer`` on Nx3 numpy descriptor arrays, or with
  ``post="prepared"`` ``make_prepped_xfer`` on lists prepared once per peer and
  region set (see prepared.py and docs/nixl.md for which is faster, measured).
  ``transfer()`` starts it; ``check_xfer_state`` is the non-blocking poll.
* Notifications: ``notif_msg`` on the last write, ``send_notif`` for a
  notification alone; received with ``get_new_notifs``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from xferkit import (
    Backend,
    Capabilities,
    Descriptors,
    Manifest,
    Notification,
    PluginError,
    Posted,
    ProtocolError,
    Region,
    Status,
    XferError,
)

from . import ucx_env
from .memory import gpu_visible, memory_kind
from .nixl_api import describe, load
from .prepared import MAX_ENTRIES, SlotTable, indices

POSTS = ("initialize", "prepared")
_names = itertools.count(1)
_LOCAL = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for this agent's own side


class NixlCallError(RuntimeError):
    """A NIXL call that raised; the message names the call and carries NIXL's own text."""


def _call(what: str, fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise NixlCallError(f"{what} raised {describe(exc)}") from exc


class _Blob(msgspec.Struct, frozen=True):
    name: str
    metadata: bytes


class _Remote:
    """A remote agent whose metadata this agent holds, and how many peers use it.

    ``failed`` is set when a request to it failed: NIXL keeps a failed UCX
    endpoint until the agent's metadata is removed, so the next ``connect``
    reloads it even when the metadata is the same.
    """

    __slots__ = ("failed", "metadata", "users")

    def __init__(self, metadata: bytes) -> None:
        self.metadata = metadata
        self.users = 0
        self.failed = False


class _Side:
    """The NIXL memory type of every region of one side (cpu and cuda may mix)."""

    __slots__ = ("codes", "kinds", "starts", "uniform")

    def __init__(self, manifest: Manifest) -> None:
        order = np.argsort(manifest.addrs, kind="stable")
        kinds = [memory_kind(manifest.regions[i].device) for i in order]
        self.kinds = sorted(set(kinds))
        self.uniform = self.kinds[0] if len(self.kinds) == 1 else None
        self.starts = manifest.addrs[order]
        self.codes = np.array([self.kinds.index(k) for k in kinds], dtype=np.int64)

    def codes_of(self, addrs: np.ndarray) -> np.ndarray:
        return self.codes[np.searchsorted(self.starts, addrs, side="right") - 1]


class _PeerHandle:
    __slots__ = ("manifest", "name", "prepared", "side")

    def __init__(self, name: str, manifest: Manifest) -> None:
        self.name = name
        self.manifest = manifest
        self.side = _Side(manifest)
        self.prepared: _Prepared | None = None


class _Prepared:
    """Slot tables for one peer and one local region set; the NIXL lists, once one matches."""

    __slots__ = ("kinds", "lists", "local", "manifest", "remote")

    def __init__(self, manifest: Manifest, local: SlotTable, remote: SlotTable, kinds) -> None:
        self.manifest = manifest  # the local manifest the local table was made from
        self.local, self.remote = local, remote
        self.kinds = kinds  # (local, remote) NIXL memory types
        self.lists: tuple[Any, Any] | None = None

    def prepare(self, agent, peer: str) -> tuple[Any, Any]:
        if self.lists is None:
            lkind, rkind = self.kinds
            ld = _call(
                "prep_xfer_dlist(local)", agent.prep_xfer_dlist, _LOCAL, self.local.rows(), lkind
            )
            try:
                rd = _call(
                    f"prep_xfer_dlist({peer})",
                    agent.prep_xfer_dlist,
                    peer,
                    self.remote.rows(),
                    rkind,
                )
            except Exception:
                ld.release()
                raise
            self.lists = (ld, rd)
        return self.lists

    def release(self) -> None:
        lists, self.lists = self.lists, None
        for dlist in lists or ():
            dlist.release()


class _Xfer(Posted):
    """One posted batch: one NIXL request, or one per memory-kind pair when kinds mix."""

    __slots__ = (
        "_agent",
        "_error",
        "_handles",
        "_notify",
        "_peer",
        "_pending",
        "_remote",
        "_status",
    )

    def __init__(self, agent, peer: str, remote, handles: list, states: list[str], notify) -> None:
        self._agent = agent
        self._peer = peer
        self._remote: _Remote | None = remote
        self._handles = handles
        self._pending = [h for h, st in zip(handles, states, strict=True) if st != "DONE"]
        self._notify = notify  # sent with send_notif once every request is done
        self._status = Status.PENDING
        self._error = ""
        if "ERR" in states:
            self._fail("transfer() returned ERR")

    def _fail(self, text: str) -> None:
        self._error = f"NIXL transfer to agent {self._peer}: {text}"
        self._status = Status.FAILED
        if self._remote is not None:
            self._remote.failed = True

    def poll(self) -> Status:
        if self._status is not Status.PENDING:
            return self._status
        check = self._agent.check_xfer_state
        while self._pending:
            try:
                state = check(self._pending[-1])
            except Exception as exc:  # e.g. nixlRemoteDisconnectError: raised, not returned
                self._fail(f"check_xfer_state raised {describe(exc)}")
                return self._status
            if state == "PROC":
                return Status.PENDING
            if state != "DONE":
                self._fail(f"check_xfer_state returned {state}")
                return self._status
            self._pending.pop()
        if self._notify is not None:
            try:
                self._agent.send_notif(self._peer, self._notify)
            except Exception as exc:
                self._fail(f"data written, but send_notif raised {describe(exc)}")
                return self._status
            self._notify = None
        self._status = Status.DONE
        return self._status

    @property
    def error(self) -> str:
        return self._error

    def block(self, timeout: float) -> None:
        # NIXL has no blocking wait: poll, spinning for the first 100 us, then napping 50 us
        # between checks (a request on a NIC can take long; a busy loop would hold a core).
        start = time.perf_counter()
        deadline = start + timeout
        while self.poll() is Status.PENDING:
            now = time.perf_counter()
            if now >= deadline:
                return
            time.sleep(0 if now - start < 1e-4 else min(5e-5, deadline - now))

    def release(self) -> None:
        first: BaseException | None = None
        for h in self._handles:
            try:
                h.release()  # NIXL cancels a request still in flight, or raises
            except Exception as exc:
                first = first or NixlCallError(f"release_xfer_handle raised {describe(exc)}")
        self._handles = []
        if first is not None:
            raise first


class _Done(Posted):
    """A notification sent on its own (an empty batch): done when posted."""

    def poll(self) -> Status:
        return Status.DONE

    @property
    def error(self) -> str:
        return ""


class NixlBackend(Backend):
    """xferkit over one NIXL agent.

    Options: ``backends`` (NIXL backend plugins the agent creates, default
    ``["UCX"]``), ``agent_prefix`` (start of the agent name; the pid, a counter
    and a random tag follow, so names are unique per process and rank),
    ``post`` ("initialize" or "prepared"), ``max_batch`` (descriptors per NIXL
    request; 0 = no limit), ``progress_thread`` (NIXL's progress thread, which
    a passive target needs: without it nothing answers a peer's connection
    set-up or takes in notifications until this process calls into NIXL) and
    ``progress_delay_us`` (how long that thread sleeps in poll() between
    rounds when no event wakes it; NIXL's Python API fixes 0, a busy spin
    that keeps one core at 100% per agent; 0 restores it).
    """

    name = "nixl"

    def __init__(
        self,
        *,
        backends: Sequence[str] = ("UCX",),
        agent_prefix: str = "xferkit",
        post: str = "initialize",
        max_batch: int = 0,
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
    ) -> None:
        super().__init__()
        if post not in POSTS:
            raise PluginError(f"nixl: post={post!r} is not one of {POSTS}")
        if isinstance(backends, str) or not backends:
            raise PluginError(f"nixl: backends must be a non-empty list of names, not {backends!r}")
        self.post = post
        self.env_notes = ucx_env.apply_defaults()  # before the first agent of the process
        api, self._bindings = load()
        self.agent_name = f"{agent_prefix}-{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False, backends=list(backends)
        )
        try:
            self._agent = _new_agent(
                api, self._bindings, self.agent_name, config, progress_delay_us
            )
        except Exception as exc:
            raise PluginError(f"nixl: creating agent {self.agent_name}: {describe(exc)}") from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            plugins = self._agent.get_plugin_list()
            self._agent = None  # released now, not whenever the traceback goes
            raise PluginError(
                f"nixl: agent {self.agent_name} could not create backend(s) {missing}; "
                f"NIXL plugins here: {plugins}"
            )
        memory = {"cpu"}
        if gpu_visible() and all(
            "VRAM_SEG" in self._agent.get_backend_mem_types(b) for b in backends
        ):
            memory.add("cuda")
        self.capabilities = Capabilities(
            memory=frozenset(memory), notifications=True, cross_process=True, max_batch=max_batch
        )
        self._regs: dict[tuple[int, int, str], Any] = {}
        self._remotes: dict[str, _Remote] = {}
        self._handles: list[_PeerHandle] = []
        self._side: _Side | None = None
        self.posts = {"initialize": 0, "prepared": 0, "notify": 0}  # requests made, by path

    # -- registration ------------------------------------------------------------

    def _register_region(self, region: Region) -> None:
        kind, dev = memory_kind(region.device)
        reg = _call(
            f"register_memory({kind}, device {dev})",
            self._agent.register_memory,
            [(region.addr, region.nbytes, dev, "")],
            kind,
        )
        self._regs[(region.addr, region.nbytes, region.device)] = reg
        self._forget_local()

    def _deregister_region(self, region: Region) -> None:
        reg = self._regs.pop((region.addr, region.nbytes, region.device), None)
        if reg is None:
            raise ValueError(f"[{region.addr:#x}, +{region.nbytes}) is not registered")
        self._forget_local()
        _call("deregister_memory", self._agent.deregister_memory, reg)

    def _forget_local(self) -> None:
        """The local region set changes: lists prepared from the old one go."""
        self._side = None
        for handle in self._handles:
            if handle.prepared is not None:
                handle.prepared.release()
                handle.prepared = None

    # -- peers -------------------------------------------------------------------

    def _endpoint(self) -> bytes:
        metadata = _call("get_agent_metadata", self._agent.get_agent_metadata)
        return msgspec.msgpack.encode(_Blob(self.agent_name, metadata))

    def _connect(self, blob: bytes, manifest: Manifest) -> tuple[str, Any]:
        try:
            b = msgspec.msgpack.decode(blob, type=_Blob)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"nixl: malformed endpoint: {exc}") from exc
        if b.name != self.agent_name:  # an agent reaches itself without its own metadata
            self._load(b)
            self._remotes[b.name].users += 1
        handle = _PeerHandle(b.name, manifest)
        self._handles.append(handle)
        return b.name, handle

    def _load(self, b: _Blob) -> None:
        known = self._remotes.get(b.name)
        if known is not None and known.metadata == b.metadata and not known.failed:
            return
        # NIXL refuses new metadata under a name it holds (a restarted or re-registered
        # peer): remove the old first; that also drops a failed UCX endpoint, which NIXL
        # would otherwise keep. Peers already using the name follow the new metadata.
        for handle in self._handles:
            if handle.name == b.name and handle.prepared is not None:
                handle.prepared.release()  # lists prepared against the old metadata
                handle.prepared = None
        if known is not None or self._agent.check_remote_metadata(b.name):
            try:
                self._agent.remove_remote_agent(b.name)
            except Exception as exc:
                raise ProtocolError(
                    f"nixl: dropping the old metadata of peer {b.name}: {describe(exc)}",
                    subject=b.name,
                ) from exc
        try:
            self._agent.add_remote_agent(b.metadata)
        except Exception as exc:
            self._remotes.pop(b.name, None)
            raise ProtocolError(
                f"nixl: loading the metadata of peer {b.name} (add_remote_agent): {describe(exc)}",
                subject=b.name,
            ) from exc
        remote = _Remote(b.metadata)
        remote.users = known.users if known is not None else 0
        self._remotes[b.name] = remote

    def _disconnect(self, handle: _PeerHandle) -> None:
        self._handles.remove(handle)
        if handle.prepared is not None:
            handle.prepared.release()
            handle.prepared = None
        remote = self._remotes.get(handle.name)
        if remote is None:
            return
        remote.users -= 1
        if remote.users <= 0:
            del self._remotes[handle.name]
            _call(
                f"remove_remote_agent({handle.name})", self._agent.remove_remote_agent, handle.name
            )

    # -- posting -------------------------------------------------------------------

    def _post(self, handle: _PeerHandle, descs: Descriptors, notify: bytes | None) -> Posted:
        agent, peer = self._agent, handle.name
        if not len(descs):  # a notification alone
            try:
                agent.send_notif(peer, notify or b"")
            except Exception as exc:
                if (remote := self._remotes.get(peer)) is not None:
                    remote.failed = True
                raise NixlCallError(f"send_notif to {peer} raised {describe(exc)}") from exc
            self.posts["notify"] += 1
            return _Done()
        if self._side is None:
            assert self.manifest is not None
            self._side = _Side(self.manifest)
        here, there = self._side, handle.side
        if here.uniform is not None and there.uniform is not None:
            groups = [(here.uniform, there.uniform, descs)]
        else:
            groups = _split_by_kind(here, there, descs)
        # The notification rides on the one request; with several (memory kinds mixed), or
        # when it is empty (NIXL drops an empty notif_msg), it follows them with send_notif.
        after = notify if notify is not None and (len(groups) > 1 or not notify) else None
        riding = b"" if after is not None or notify is None else notify
        remote = self._remotes.get(peer)
        handles, states = [], []
        try:
            for lkind, rkind, part in groups:
                h = self._request(handle, lkind, rkind, part, riding, len(groups) == 1)
                handles.append(h)
                try:
                    states.append(agent.transfer(h))
                except Exception as exc:
                    raise NixlCallError(f"transfer() to {peer} raised {describe(exc)}") from exc
        except Exception:
            if remote is not None:
                remote.failed = True
            for h in handles:
                with contextlib.suppress(Exception):  # the first failure is the one reported
                    h.release()
            raise
        return _Xfer(agent, peer, remote, handles, states, after)

    def _request(self, handle: _PeerHandle, lkind, rkind, d: Descriptors, notify, uniform: bool):
        """A NIXL request (not yet posted) moving ``d`` to the peer."""
        if self.post == "prepared" and uniform:
            prepared = self._prepared(handle, lkind, rkind)
            pairs = prepared and indices(prepared.local, prepared.remote, d)
            if pairs:
                ld, rd = prepared.prepare(self._agent, handle.name)  # type: ignore[union-attr]
                self.posts["prepared"] += 1
                return _call(
                    f"make_prepped_xfer(WRITE, {len(pairs[0])} entries) to {handle.name}",
                    self._agent.make_prepped_xfer,
                    "WRITE",
                    ld,
                    pairs[0],
                    rd,
                    pairs[1],
                    notify,
                )
        self.posts["initialize"] += 1
        seg = self._bindings
        try:
            return self._agent.initialize_xfer(
                "WRITE",
                seg.nixlXferDList(_segment(seg, lkind[0]), _rows(d.src, d.nbytes, lkind[1])),
                seg.nixlXferDList(_segment(seg, rkind[0]), _rows(d.dst, d.nbytes, rkind[1])),
                handle.name,
                notify,
            )
        except Exception as exc:
            raise NixlCallError(
                f"initialize_xfer(WRITE, {len(d)} descriptors) to {handle.name} raised "
                f"{describe(exc)}"
            ) from exc

    def _prepared(self, handle: _PeerHandle, lkind, rkind) -> _Prepared | None:
        """Slot tables for this peer and the registered regions (None: too many slots)."""
        p = handle.prepared
        if p is not None and p.manifest is self.manifest:
            return p
        assert self.manifest is not None
        local, remote = SlotTable(self.manifest, lkind[1]), SlotTable(handle.manifest, rkind[1])
        if max(local.entries, remote.entries) > MAX_ENTRIES:
            return None
        if p is not None:
            p.release()
        handle.prepared = _Prepared(self.manifest, local, remote, (lkind[0], rkind[0]))
        return handle.prepared

    # -- notifications, close ---------------------------------------------------------

    def _notifications(self) -> list[Notification]:
        notes = _call("get_new_notifs", self._agent.get_new_notifs)
        return [Notification(str(peer), bytes(m)) for peer, msgs in notes.items() for m in msgs]

    def _close(self) -> None:
        for handle in list(self._handles):
            if handle.prepared is not None:
                handle.prepared.release()
                handle.prepared = None
        self._handles.clear()
        first: XferError | None = None
        for name in list(self._remotes):
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                error = XferError(f"nixl: remove_remote_agent({name}): {describe(exc)}")
                first = first or error
        self._remotes.clear()
        self._agent = None  # the agent (and its UCX workers) goes with its last reference
        if first is not None:
            raise first


_agent_lock = threading.Lock()


def _new_agent(api, bindings, name: str, config, delay_us: int):
    """``nixl_agent(name, config)`` with the progress thread's poll delay set to ``delay_us``.

    ``nixl_agent.__init__`` builds the C++ agent config itself and pins its
    ``pthrDelay`` to 0 (a busy spin); the one way in is the bindings' agent
    constructor, wrapped for the duration of this call.
    """
    real = bindings.nixlAgent
    if not delay_us or getattr(api, "nixlBind", None) is not bindings:
        return api.nixl_agent(name, config)

    def make(agent_name, agent_config):
        agent_config.pthrDelay = delay_us
        return real(agent_name, agent_config)

    with _agent_lock:
        bindings.nixlAgent = make
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = real


def _rows(addrs: np.ndarray, nbytes: np.ndarray, devid: int) -> np.ndarray:
    """NIXL's Nx3 (address, length, device id) array, one per side.

    Filled by column into its own array: np.stack costs several times more when
    the caches are cold after a large copy, and nixlXferDList converts a view
    into a shared (2, N, 3) array about ten times slower than an array of its own.
    """
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = devid
    return out


def _segment(bindings, kind: str):
    return bindings.DRAM_SEG if kind == "DRAM" else bindings.VRAM_SEG


def _split_by_kind(local: _Side, remote: _Side, d: Descriptors) -> list:
    """Descriptors grouped by (local kind, remote kind): one NIXL list holds one memory type."""
    lcode, rcode = local.codes_of(d.src), remote.codes_of(d.dst)
    key = lcode * len(remote.kinds) + rcode
    groups = []
    for k in np.unique(key):
        mask = key == k
        groups.append(
            (
                local.kinds[int(k) // len(remote.kinds)],
                remote.kinds[int(k) % len(remote.kinds)],
                Descriptors(d.src[mask], d.dst[mask], d.nbytes[mask]),
            )
        )
    return groups


__all__ = ["NixlBackend", "NixlCallError"]
