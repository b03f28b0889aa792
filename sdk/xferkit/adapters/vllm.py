"""vLLM's ``KVConnectorBase_V1`` over a ``Session``: the calls vLLM makes, mapped onto push.

vLLM's NIXL connector pulls: the prefill keeps a finished request's blocks and
names them in ``kv_transfer_params``; the decode reads them. A Session pushes:
the decode names its slots (``expect``), the prefill writes (``offer`` +
``write``), either first. The mapping (docs/engine.md, "vLLM-shaped connector"):

- prefill ``request_finished`` keeps the blocks (``delay_free=True``) and returns
  params naming this instance's session addresses and the request id; its worker
  then ``offer``s the request and writes every block at once (``last=True``): the
  Session holds them for ``lease_s`` until a decode rank claims them, which is
  vLLM's lease, enforced by the prefill's Session rather than a scheduler timer;
- decode ``update_state_after_alloc`` records its own new blocks; its worker
  ``expect``s them from the addresses in the params, under the prefill's id (the
  transfer's id on both sides; the decode's own id stays the engine's); with a
  local prefix cache hit the new blocks are the prompt's after the cached ones,
  and ``expect(skip=)`` drops the prefill's blocks that would fill the cached ones;
- ``get_finished`` reports a request once its handle is terminal on this rank: a
  Send DONE or FAILED (its blocks are no longer read), a Receive DONE or FAILED
  (FAILED only once nothing can land: the blocks are safe to recompute into); a
  failed Receive's blocks all go to ``get_block_ids_with_load_errors`` (the Session
  fails a request whole), for vLLM's ``recompute`` or ``fail`` policy (``valid_tokens``);
- a decode request that ends while receiving keeps its blocks (``delay_free``): the
  worker aborts the Receive and reports it sent once FAILED, since a push may still
  be landing in them.

vLLM merges what every worker reports (an id counts once every rank said it),
so one rank's FAILED Receive never frees blocks another rank still receives.
Nothing of vLLM is imported: the request, block and output objects below carry
only the fields this connector reads, with vLLM's names.
"""

from __future__ import annotations

import enum
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..backend import Backend
from ..errors import ArgumentError, XferError
from ..manifest import Manifest, Region
from ..session import Receive, Send, Session, State

log = logging.getLogger("xferkit.adapters.vllm")
POOL = "kv"
SENDABLE = frozenset({"finished_stopped", "finished_length_capped"})
"""Request statuses whose KV is handed to a decode (an aborted prefill hands nothing)."""
Policy = Literal["recompute", "fail"]


class Role(enum.Enum):
    """vLLM's ``KVConnectorRole``: one connector object per process role."""

    SCHEDULER = 0
    WORKER = 1


@dataclass
class Request:
    """The fields of vLLM's ``Request`` this connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    status: str = "waiting"


@dataclass
class Blocks:
    """vLLM's ``KVCacheBlocks`` as far as read here: the blocks allocated and not cached."""

    block_ids: list[int]

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self.block_ids)


@dataclass
class SchedulerOutput:
    """vLLM's ``SchedulerOutput``: this connector reads none of it (its own state says what
    to load and offer, as NIXL's does); an engine loop hands ``finished_req_ids`` on to
    ``get_finished``."""

    finished_req_ids: set[str] = field(default_factory=set)


@dataclass
class KVConnectorOutput:
    """vLLM's ``KVConnectorOutput`` as read here: what every worker reported done."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Load:
    """Decode side: receive ``transfer_id`` from ``sources`` into ``blocks``, the prompt's
    blocks after the first ``skip`` (those are cached here: a local prefix hit)."""

    transfer_id: str
    sources: tuple[str, ...]
    blocks: np.ndarray
    skip: int = 0


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """Scheduler -> workers, once a step: loads to ``expect``, blocks to ``offer``, loads
    to abort (their requests ended while still receiving)."""

    loads: Mapping[str, Load]
    offers: Mapping[str, np.ndarray]
    aborts: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Handshake:
    """What a worker tells its scheduler (vLLM's handshake metadata): its session address."""

    tp_rank: int
    address: str


@dataclass(frozen=True)
class ConnectorConfig:
    """``session``: ``Session.from_config``'s table (vLLM's ``kv_connector_extra_config``);
    ``backend``: opens the worker's backend instead of the table's (tests inject faults)."""

    tp_rank: int = 0
    tp_size: int = 1
    block_size: int = 16
    session: Mapping[str, Any] = field(default_factory=dict)
    backend: Callable[[], Backend] | None = None


def valid_tokens(blocks: Any, failed: Any, block_size: int, num_computed_tokens: int) -> int:
    """The tokens a request keeps after a failed load: those before its first failed block
    (vLLM's scheduler rolls ``num_computed_tokens`` back to it, then recomputes or fails)."""
    ids, bad = _ids(blocks, "valid_tokens(blocks)"), _ids(failed, "valid_tokens(failed)")
    _count(block_size, "valid_tokens(block_size)", least=1)
    _count(num_computed_tokens, "valid_tokens(num_computed_tokens)")
    hit = np.flatnonzero(np.isin(ids, bad))
    if hit.size == 0:
        return num_computed_tokens
    return min(num_computed_tokens, int(hit[0]) * block_size)


class XferkitConnector:
    """One role of the connector (``Role.SCHEDULER`` or ``Role.WORKER``), vLLM's method names;
    a call of the other role is an ``XferError``."""

    def __init__(self, role: Role, config: ConnectorConfig | None = None) -> None:
        if not isinstance(role, Role):
            raise ArgumentError(f"role is a Role, not {role!r}", subject=role)
        config = ConnectorConfig() if config is None else config
        if not isinstance(config, ConnectorConfig):
            raise ArgumentError(f"config is a ConnectorConfig, not {config!r}", subject=config)
        _count(config.block_size, "block_size", least=1)
        _count(config.tp_size, "tp_size", least=1)
        if _count(config.tp_rank, "tp_rank") >= config.tp_size:
            raise ArgumentError(f"tp_rank {config.tp_rank} >= tp_size {config.tp_size}")
        if not isinstance(config.session, Mapping):
            raise ArgumentError(f"config.session is a mapping, not {config.session!r}")
        if config.backend is not None and not callable(config.backend):
            raise ArgumentError(f"config.backend opens a Backend, not {config.backend!r}")
        self.role, self.config = role, config
        # scheduler side
        self._addresses: tuple[str, ...] = ()
        self._loads: dict[str, Load] = {}
        self._offers: dict[str, np.ndarray] = {}
        self._asked: set[str] = set()  # update_state_after_alloc may come twice
        self._loading: set[str] = set()  # loads not yet reported received
        self._aborts: set[str] = set()
        self._aborting: set[str] = set()  # loads aborted, not yet reported by every worker
        # worker side
        self.session: Session | None = None
        self._layers: frozenset[str] = frozenset()
        self._meta: ConnectorMetadata | None = None
        self._recvs: dict[str, tuple[Receive | None, np.ndarray]] = {}
        self._sends: dict[str, Send | Receive | None] = {}  # and receives abandoned
        self._sent: set[str] = set()  # terminal, not yet named in finished_req_ids
        self._finished: set[str] = set()  # named in finished_req_ids, not yet terminal
        self._failed: set[int] = set()

    # -- scheduler side ----------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Handshake]) -> None:
        """Every worker's address, by TP rank: what a decode of this instance's requests
        passes as ``expect(source=)``."""
        self._as(Role.SCHEDULER, "set_xfer_handshake_metadata")
        if not isinstance(metadata, Mapping) or set(metadata) != set(range(self.config.tp_size)):
            raise ArgumentError(
                f"set_xfer_handshake_metadata() takes one Handshake per TP rank "
                f"0..{self.config.tp_size - 1}, not {metadata!r}"
            )
        if not all(isinstance(h, Handshake) for h in metadata.values()):
            raise ArgumentError(f"set_xfer_handshake_metadata(): not Handshakes: {metadata!r}")
        self._addresses = tuple(metadata[r].address for r in range(self.config.tp_size))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Decode side: the prompt not computed here arrives asynchronously (the request waits
        until ``get_finished`` reports it received). ``num_computed_tokens`` is a local prefix
        cache hit (whole blocks): only the tokens after it load, the prefill's blocks for the
        cached ones are skipped (``update_state_after_alloc``)."""
        self._as(Role.SCHEDULER, "get_num_new_matched_tokens")
        params = _params(request)
        computed = _count(num_computed_tokens, "num_computed_tokens")
        if params.get("do_remote_prefill") and request.request_id in self._aborting:
            return None, False  # its id's earlier load is still being aborted: ask again later
        if not params.get("do_remote_prefill") or request.request_id in self._asked:
            return 0, False
        rest = len(_prompt(request)) - computed
        if rest <= 0:  # all of it computed here: nothing to load
            return 0, False
        self._whole_blocks(computed, request.request_id, "num_computed_tokens")
        return rest, True

    def update_state_after_alloc(
        self, request: Request, blocks: Blocks, num_external_tokens: int
    ) -> None:
        """Decode side: the new blocks are the load's slots, the prompt's after the
        ``len(prompt) - num_external_tokens`` tokens computed here (a local prefix hit); the
        prefill sends ``remote_num_blocks`` and the load skips those that fill cached blocks
        (vLLM's NIXL reads only the remote blocks past the hit)."""
        self._as(Role.SCHEDULER, "update_state_after_alloc")
        params = _params(request)
        _count(num_external_tokens, "num_external_tokens")
        rid = request.request_id
        if not num_external_tokens or not params.get("do_remote_prefill") or rid in self._asked:
            return
        if rid in self._aborting:  # one id, two loads: the worker could not tell them apart
            raise XferError(
                f"request {rid!r}: an earlier load under this id is still being aborted "
                "(get_num_new_matched_tokens said to wait)",
                subject=rid,
            )
        try:
            ids = _ids(blocks.get_unhashed_block_ids(), "blocks")
        except AttributeError:
            raise ArgumentError(f"blocks are KVCacheBlocks, not {blocks!r}") from None
        need = _count(params.get("remote_num_blocks"), "kv_transfer_params remote_num_blocks")
        sources = params.get("remote_addresses")
        transfer = params.get("remote_request_id")
        if (
            not isinstance(transfer, str)
            or not isinstance(sources, list | tuple)
            or not sources
            or not all(isinstance(a, str) for a in sources)
        ):
            raise ArgumentError(f"request {rid!r}: kv_transfer_params name no prefill: {params}")
        cached = len(_prompt(request)) - num_external_tokens
        if cached < 0:
            raise ArgumentError(
                f"request {rid!r}: num_external_tokens {num_external_tokens} is past the prompt",
                subject=rid,
            )
        skip = self._whole_blocks(cached, rid, "the locally computed prefix")
        if skip > need:
            raise XferError(
                f"request {rid!r}: {skip} blocks cached here, the prefill sends only {need}",
                subject=rid,
            )
        want = need - skip
        if ids.size < want or math.ceil(num_external_tokens / self.config.block_size) > ids.size:
            raise XferError(
                f"request {rid!r}: {ids.size} blocks allocated, the prefill sends {want} "
                f"past the {skip} cached",
                subject=rid,
            )
        self._asked.add(rid)
        self._loading.add(rid)
        self._loads[rid] = Load(transfer, tuple(sources), ids[:want], skip)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Every step, even an empty one: what was decided since the last step."""
        self._as(Role.SCHEDULER, "build_connector_meta")
        meta = ConnectorMetadata(self._loads, self._offers, frozenset(self._aborts))
        self._loads, self._offers, self._aborts = {}, {}, set()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Every worker's reports, merged: the loads that ended are no longer in flight."""
        self._as(Role.SCHEDULER, "update_connector_output")
        received = getattr(connector_output, "finished_recving", None)
        sent = getattr(connector_output, "finished_sending", None)
        if not isinstance(received, set | frozenset | None) or not isinstance(
            sent, set | frozenset | None
        ):
            raise ArgumentError(f"not a KVConnectorOutput: {connector_output!r}")
        self._loading -= received or set()
        self._aborting -= sent or set()  # an aborted load is reported sent once FAILED

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks (True) until ``get_finished`` says sent, and name
        this instance to the decode. Anything else frees at once."""
        self._as(Role.SCHEDULER, "request_finished")
        params = _params(request)
        one = block_ids[0] if isinstance(block_ids, tuple) and len(block_ids) == 1 else block_ids
        ids = _ids(one, "block_ids")  # a list, or one KV-cache group's (the HMA shape)
        self._asked.discard(request.request_id)
        if request.request_id in self._loading:  # ended while its load may still be landing:
            self._loading.discard(request.request_id)  # the blocks wait for the aborted load
            self._aborts.add(request.request_id)  # to be FAILED, then read as "sent"
            self._aborting.add(request.request_id)
            return True, None
        status = getattr(request, "status", None)
        status = str(getattr(status, "name", status)).lower()  # vLLM's RequestStatus or a str
        computed = _count(getattr(request, "num_computed_tokens", None), "num_computed_tokens")
        if not params.get("do_remote_decode") or status not in SENDABLE or ids.size == 0:
            return False, None
        if not self._addresses:
            raise XferError("request_finished(): no worker handshake yet (set_xfer_handshake...)")
        self._offers[request.request_id] = ids
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": request.request_id,
            "remote_addresses": list(self._addresses),
            "remote_num_blocks": int(ids.size),
            "remote_num_tokens": computed,
            "tp_size": self.config.tp_size,
        }

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """One region per layer and K/V from vLLM's caches (numpy or torch): ``[2, blocks,
        block_size, heads, dim]`` (K and V stacked, NHD) or ``[blocks, block_size, dim]``
        (MLA); the layer index is the first number in the layer's name; then the Session."""
        self._as(Role.WORKER, "register_kv_caches")
        if self.session is not None:
            raise XferError("register_kv_caches(): the caches are registered already")
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ArgumentError(f"kv_caches map layer names to tensors, not {kv_caches!r}")
        regions = [r for name, cache in kv_caches.items() for r in _regions(name, cache)]
        c = self.config
        manifest = Manifest.build(regions, tp_rank=c.tp_rank, tp_size=c.tp_size)
        backend = c.backend() if c.backend is not None else None
        try:
            self.session = Session.from_config(manifest, dict(c.session), backend=backend)
        except BaseException:
            if isinstance(backend, Backend):
                backend.close()  # a Session refused holds nothing, nor does this connector
            raise
        self._layers = frozenset(kv_caches)

    def get_handshake_metadata(self) -> Handshake:
        return Handshake(self.config.tp_rank, self._session("get_handshake_metadata").address)

    def bind_connector_metadata(self, connector_metadata: ConnectorMetadata) -> None:
        self._as(Role.WORKER, "bind_connector_metadata")
        if not isinstance(connector_metadata, ConnectorMetadata):
            raise ArgumentError(f"not ConnectorMetadata: {connector_metadata!r}")
        self._meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._as(Role.WORKER, "clear_connector_metadata")
        self._meta = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Every step: ``expect`` each load, ``offer`` and write each finished prefill. A
        call the Session refuses fails that request (reported by ``get_finished``)."""
        session = self._session("start_load_kv")
        if self._meta is None:
            raise XferError("start_load_kv(): no connector metadata bound this step")
        for rid, load in self._meta.loads.items():
            try:
                skip = {POOL: load.skip} if load.skip else None
                recv: Receive | None = session.expect(
                    load.transfer_id, load.sources, {POOL: load.blocks}, skip=skip
                )
            except XferError as exc:
                log.warning("request %r: expect() refused: %s", rid, exc)
                recv = None
            self._recvs[rid] = (recv, load.blocks)
        for rid in self._meta.aborts:  # a receive abandoned: its blocks free once it is FAILED
            recv, _ = self._recvs.pop(rid, (None, None))
            if recv is not None:
                recv.abort(timeout=0)
            self._sends[rid] = recv  # reported with the sends: vLLM frees delayed blocks so
        for rid, blocks in self._meta.offers.items():
            if self._sends.get(rid) is not None:  # finished twice: its live Send reads on
                log.warning("request %r: offered again while its Send is live: ignored", rid)
                continue
            send: Send | None = None
            try:
                send = session.offer(rid)
                send.write({POOL: blocks}, last=True)
            except XferError as exc:  # the id was used, or a block refused: nothing is read
                log.warning("request %r: offer() refused: %s", rid, exc)
                if send is not None:  # offered, never written: the decode must not wait on it
                    send.abort(timeout=0)
            self._sends[rid] = send

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous (the request is not scheduled until
        received), so no layer of a running request is ever still loading."""
        self._layer(layer_name, "wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: a request is written whole, every layer in one plan, once it
        finished (``request_finished``), as vLLM's NIXL connector hands it over. A Send can
        write one layer's share (``write(layers=)``), but which requests end their prefill
        in this step is the scheduler's to say first (docs/engine.md)."""
        self._layer(layer_name, "save_kv_layer")

    def wait_for_save(self) -> None:
        """Nothing to wait for: the blocks stay held until ``get_finished`` says sent."""
        self._as(Role.WORKER, "wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(done sending, done receiving) on this rank, each once. A send is reported only
        once vLLM also named it finished (this call or an earlier one); a failed receive's
        blocks go to ``get_block_ids_with_load_errors`` in the same step."""
        self._as(Role.WORKER, "get_finished")
        if not isinstance(finished_req_ids, set | frozenset) or not all(
            isinstance(r, str) for r in finished_req_ids
        ):
            raise ArgumentError(f"finished_req_ids is a set of ids, not {finished_req_ids!r}")
        received = set()
        for rid, (recv, blocks) in list(self._recvs.items()):
            state = State.FAILED if recv is None else recv.poll()
            if state in (State.DONE, State.FAILED):
                del self._recvs[rid]
                received.add(rid)
                if state is State.FAILED:  # the root cause, for the engine's log
                    self._failed.update(blocks.tolist())
                    if recv is not None:
                        log.warning("request %r: the load failed: %s", rid, recv.error)
        for rid, send in list(self._sends.items()):
            if send is None or send.done:
                del self._sends[rid]
                self._sent.add(rid)
        self._finished |= finished_req_ids & (self._sent | self._sends.keys())
        sent = self._sent & self._finished
        self._sent -= sent
        self._finished -= sent
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of every load that failed since the last call (all of its blocks)."""
        self._as(Role.WORKER, "get_block_ids_with_load_errors")
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()

    # -- helpers -----------------------------------------------------------------------

    def _as(self, role: Role, call: str) -> None:
        if self.role is not role:
            raise XferError(f"{call}() is a {role.name.lower()}-side call; this is the {self.role}")

    def _whole_blocks(self, tokens: int, rid: str, what: str) -> int:
        """``tokens`` in blocks; a prefix cache holds whole blocks, so anything else is wrong."""
        blocks, rest = divmod(tokens, self.config.block_size)
        if rest:
            raise ArgumentError(
                f"request {rid!r}: {what} ({tokens} tokens) is not whole blocks of "
                f"{self.config.block_size}",
                subject=rid,
            )
        return blocks

    def _session(self, call: str) -> Session:
        self._as(Role.WORKER, call)
        if self.session is None:
            raise XferError(f"{call}(): register_kv_caches() first")
        return self.session

    def _layer(self, layer_name: object, call: str) -> None:
        self._session(call)
        if layer_name not in self._layers:
            raise ArgumentError(f"{call}(): no layer {layer_name!r} registered", subject=layer_name)


def _regions(name: object, cache: Any) -> list[Region]:
    found = re.search(r"\d+", name) if isinstance(name, str) else None
    if found is None:
        raise ArgumentError(f"layer name {name!r} holds no layer number", subject=name)
    layer, raw = int(found.group()), getattr(cache, "shape", None)
    shape: tuple[Any, ...] = raw if isinstance(raw, tuple) else ()  # torch.Size is a tuple
    if len(shape) == 5 and shape[0] == 2:  # K and V stacked, NHD pages: heads are TP-sharded
        axes = ("token", "head", "dim")
        try:
            halves = [cache[0], cache[1]]
        except (TypeError, IndexError, KeyError):
            raise ArgumentError(f"layer {name!r}: {cache!r} cannot be indexed") from None
        return [
            Region.from_array(half, pool=POOL, name=kv, layer=layer, tp_axis=1, axes=axes)
            for half, kv in zip(halves, ("k", "v"), strict=True)
        ]
    if len(shape) == 3:  # MLA's latent cache: one per layer, the same on every TP rank
        return [Region.from_array(cache, pool=POOL, name="latent", layer=layer)]
    raise ArgumentError(
        f"layer {name!r}: a cache is [2, blocks, block_size, heads, dim] or "
        f"[blocks, block_size, dim], not shape {shape!r}",
        subject=name,
    )


def _params(request: object) -> dict[str, Any]:
    rid = getattr(request, "request_id", None)
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(rid, str) or not isinstance(params, dict | None):
        raise ArgumentError(f"not a vLLM-shaped Request: {request!r}", subject=request)
    return params or {}


def _prompt(request: Request) -> list[int]:
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(prompt, list):
        raise ArgumentError(f"request {request.request_id!r}: prompt_token_ids is no list")
    return prompt


def _ids(value: object, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception:
        arr = np.zeros((0, 0))
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or (arr < 0).any())):
        raise ArgumentError(f"{what}: block ids are non-negative ints, not {value!r}")
    return arr.astype(np.int64) if arr.size else np.zeros(0, np.int64)  # any empty dtype


def _count(value: object, what: str, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ArgumentError(f"{what} must be an int >= {least}, not {value!r}", subject=value)
    return value
