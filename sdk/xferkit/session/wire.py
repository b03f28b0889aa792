"""The Session's control messages: msgspec Structs in one tagged union, msgpack on the wire.

Every message a peer can send is declared here, with bounds on every field,
so ``decode`` is the only gate: anything malformed, of an unknown type,
oversized or out of range is a ``ProtocolError`` and never reaches the
session's state. Nothing is pickled. docs/protocol.md describes each message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import numpy as np

from ..errors import ProtocolError

PROTOCOL_VERSION = 5
"""Sent in ``Hello``/``Welcome``; a peer speaking another version is refused at handshake."""

MAX_MESSAGE = 64 << 20
"""Largest control message accepted (bytes); a manifest of thousands of regions fits."""

MAX_SLOTS = 1 << 22
"""Most slot indices one request may name per pool."""

MAX_LAYERS = 1 << 16
"""Layer ids a layer-wise staged round may name."""

SLOT = "<u4"
"""How a ``Request`` packs slot indices: little-endian uint32, 4 bytes a slot (numpy dtype)."""

U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=4096)]
Size = Annotated[int, msgspec.Meta(ge=1, le=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Slot = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_TEXT = 16384
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]
Blob = Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE)]
Stage = Annotated[str, msgspec.Meta(max_length=32)]
Pool = Annotated[str, msgspec.Meta(max_length=256)]
Slots = Annotated[
    dict[
        Pool,
        Annotated[bytes, msgspec.Meta(max_length=4 * MAX_SLOTS)],
    ],
    msgspec.Meta(max_length=256),
]


class _Msg(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=False):
    pass


class _Introduction(_Msg, frozen=True):
    """Who a rank is and what it registered: what each side of a pair tells the other once."""

    version: int
    incarnation: U64
    address: Name  # the sender's own session address (for log lines and errors)
    tp_rank: Rank
    tp_size: Size
    fingerprint: Name
    manifest: Blob
    backend: Name
    endpoint: Blob
    driver_address: Name


class Hello(_Introduction, frozen=True, tag="hello"):
    """Decode -> prefill, once per pair. The decode rank's place (``tp_rank`` of ``tp_size``,
    stage ``pp_rank`` of ``pp_size``) is bound to the connection: every ``Request`` on it is
    for that place."""

    pp_rank: Rank = 0
    pp_size: Size = 1
    resume: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    """A digest of the prefill's address keyed by a secret of this Session's: a Hello on a new
    connection that carries the one a live pair's Hello carried is that decode rank coming back
    (it declared the pair lost), and replaces the pair; anyone else naming its memory is refused."""
    pokes: bool = False
    """This rank polls its driver's notifications (the driver has no descriptor to wait on):
    send it a ``Poke`` as each write to it ends, so that it reads that notification then
    rather than at its next poll."""


class Welcome(_Introduction, frozen=True, tag="welcome"):
    """Prefill -> decode, the reply to ``Hello``; ``error`` (with ``stage``) when the pair cannot
    work (a PlanError's text, a refused endpoint): both sides then report that same text.

    ``staging`` ("auto", "always" or "never"), ``descriptor_bytes``, ``copy_cost`` and
    ``slice_bytes`` (the prefill rank's staging slice) are what the decode rank needs to
    choose the same routes and cut the same rounds as the prefill rank. ``drain_s`` bounds how
    long the prefill rank's aborted writes may stay in its driver: a decode rank that gets no
    ``AbortAck`` keeps a failing request's slots out of reuse that long.
    """

    stage: Stage = ""
    error: Text = ""
    drain_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 10.0
    staging: Stage = "never"
    descriptor_bytes: U64 = 0
    copy_cost: Annotated[float, msgspec.Meta(gt=0, lt=1e6)] = 1.0
    slice_bytes: U64 = 0


class Request(_Msg, frozen=True, tag="request"):
    """Decode -> prefill, the hot-path message: one per (destination rank, source rank).

    It claims the sender's place (from its ``Hello``) in request ``rid``: only this
    connection may then abort, fail or unpack it. ``needed`` is False when the plans say
    this source writes nothing into this destination rank; the source still counts it,
    so it knows when every destination rank of the request has been served. ``slots``
    packs each pool's slot indices as ``SLOT``; ``skip[pool]`` destination slots' worth of
    the request's first pages are held here already (a prefix cache), so the source's
    pages that would fill them are not sent. ``failed`` (with ``stage``) claims the
    place for a request that already failed on the decode side (before it could ask):
    the prefill rank fails it with that text and writes nothing.
    """

    rid: RequestId
    gen: U64
    needed: bool
    slots: Slots
    registration: U64 = 0  # the decode backend's registration generation now (stale check)
    staging: U64 = 0  # address of the staging slice this source may write rounds into (0: none)
    staging_bytes: U64 = 0
    stage: Stage = ""
    failed: Text = ""
    skip: Annotated[dict[Pool, Count], msgspec.Meta(max_length=256)] = msgspec.field(
        default_factory=dict
    )


class Abort(_Msg, frozen=True, tag="abort"):
    """Decode -> prefill: stop writing ``rid``, for this root cause; answered by ``AbortAck``
    once no write of it is in flight or will be posted."""

    rid: RequestId
    gen: U64
    stage: Stage
    text: Text


class AbortAck(_Msg, frozen=True, tag="abort_ack"):
    """Prefill -> decode: nothing of ``rid`` is in flight towards the sender any more, or
    (``barrier``: its driver's ends are not final) an ``Ended`` notification follows the
    last of its bytes on the data path."""

    rid: RequestId
    gen: U64
    barrier: bool = False


class Fail(_Msg, frozen=True, tag="fail"):
    """Either way: ``rid`` failed on the sender's side with this root cause.

    From a prefill rank it also means nothing of it is in flight any more, or, with
    ``barrier``, that an ``Ended`` notification follows the last of its bytes (``AbortAck``).
    """

    rid: RequestId
    gen: U64
    stage: Stage
    text: Text
    barrier: bool = False


class Round(msgspec.Struct, frozen=True, array_like=True):
    """Which staged round a write carries: round ``index`` of chunk ``chunk``, whose slots are
    ``at[pool] = (first, count, sources)``: ``count`` of the destination's slots of the request
    from ``first``, filled from ``sources`` source slots (more or fewer when pages differ),
    landed in ``half`` of the staging slice the destination offered (when it unpacks), of
    the regions of ``layers`` only when the chunk was written layer by layer."""

    chunk: Count
    index: Count
    at: Annotated[dict[Pool, tuple[Count, Count, Count]], msgspec.Meta(max_length=256)]
    half: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0  # of the decode rank's slice
    layers: Annotated[list[Count], msgspec.Meta(max_length=MAX_LAYERS)] | None = None


class Written(_Msg, frozen=True, tag="written"):
    """Prefill -> decode, only for drivers without notifications: write ``seq`` of ``rid``
    landed; ``total`` (> 0) on the last one says how many writes there were."""

    rid: RequestId
    gen: U64
    src_rank: Rank
    seq: Count
    total: Count
    round: Round | None = None


class Unpacked(_Msg, frozen=True, tag="unpacked"):
    """Decode -> prefill: round ``index`` of staged chunk ``chunk`` is out of the staging half
    it landed in, which the next round may now overwrite."""

    rid: RequestId
    gen: U64
    chunk: Count
    index: Count


class Poke(_Msg, frozen=True, tag="poke"):
    """Prefill -> decode, to a rank whose ``Hello`` asked: a write to it ended, read the
    driver's notifications now. It carries nothing else: the notification is what counts."""


class Ping(_Msg, frozen=True, tag="ping"):
    """Decode -> prefill heartbeat, per peer (not per request)."""

    incarnation: U64


class Pong(_Msg, frozen=True, tag="pong"):
    """Prefill -> decode heartbeat reply; a changed ``incarnation`` means the peer restarted."""

    incarnation: U64


class Bye(_Msg, frozen=True, tag="bye"):
    """Either way: the sender's session is closing; its open requests with us are failed."""

    incarnation: U64
    reason: Text


class Renew(_Msg, frozen=True, tag="renew"):
    """Decode -> prefill: keep holding these requests (written, not yet claimed) for another
    lease each; ids held nowhere here are ignored."""

    rids: Annotated[list[RequestId], msgspec.Meta(min_length=1, max_length=4096)]


class Join(_Msg, frozen=True, tag="join"):
    """Group member -> the rank serving the group's roster, every heartbeat: here I am."""

    incarnation: U64
    address: Name
    tp_rank: Rank
    tp_size: Size
    pp_rank: Rank
    pp_size: Size


class Joined(_Msg, frozen=True, tag="joined"):
    """Roster server -> member, the reply to ``Join``; ``error`` when it was refused."""

    error: Text = ""


class Lookup(_Msg, frozen=True, tag="lookup"):
    """Decode -> roster server: which ranks make up the group, at which session addresses?"""


class Member(msgspec.Struct, frozen=True, array_like=True):
    """One rank of a group: its session address and place in the TP x PP grid."""

    address: Name
    tp_rank: Rank
    pp_rank: Rank


class Roster(_Msg, frozen=True, tag="roster"):
    """Roster server -> decode, the reply to ``Lookup``: the ranks known so far, ordered by
    (pp_rank, tp_rank); complete when there are ``tp_size * pp_size`` of them."""

    tp_size: Size
    pp_size: Size
    ranks: Annotated[list[Member], msgspec.Meta(max_length=4096)]
    error: Text = ""


Message = (
    Hello
    | Welcome
    | Request
    | Abort
    | AbortAck
    | Fail
    | Written
    | Unpacked
    | Poke
    | Ping
    | Pong
    | Bye
    | Renew
    | Join
    | Joined
    | Lookup
    | Roster
)


class Tag(msgspec.Struct, frozen=True, array_like=True):
    """The completion tag riding on a driver notification, after the data of one write.

    ``total`` is 0 except on a source's last write to a destination, where it is
    the number of writes: the destination counts them, never parses strings.
    """

    rid: RequestId
    gen: U64
    src_rank: Rank
    seq: Count
    total: Count
    round: Round | None = None  # set on the write of a staged round


class Ended(msgspec.Struct, frozen=True, array_like=True, tag="ended"):
    """The notification a prefill rank whose driver's ends are not final posts once its writes
    of ``rid`` to a decode rank ended unfinished: it lands behind every byte of them."""

    rid: RequestId
    gen: U64


def pack_slots(slots: Mapping[str, Any]) -> dict[str, bytes]:
    """Slot indices per pool as a ``Request`` carries them (``SLOT``)."""
    return {p: np.asarray(s).astype(SLOT, copy=False).tobytes() for p, s in slots.items()}


def written(tag: Tag) -> Written:
    """The control message carrying ``tag`` where the driver has no notifications."""
    return Written(tag.rid, tag.gen, tag.src_rank, tag.seq, tag.total, tag.round)


def tag_of(msg: Written) -> Tag:
    return Tag(msg.rid, msg.gen, msg.src_rank, msg.seq, msg.total, msg.round)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_tag_decoder = msgspec.msgpack.Decoder(Tag)
_ended_decoder = msgspec.msgpack.Decoder(Ended)


_TEXTS = ("text", "error", "reason")


def clip(text: str) -> str:
    """``text`` within what a peer decodes, its head kept (the root cause comes first): an
    over-long text would get the whole message dropped and its peer wait for a timeout."""
    if len(text) <= MAX_TEXT:
        return text
    tail = f" ... ({len(text)} characters in all)"
    return text[: MAX_TEXT - len(tail)] + tail


def encode(message: Message | Tag | Ended) -> bytes:
    for field in _TEXTS:
        value = getattr(message, field, None)
        if isinstance(value, str) and len(value) > MAX_TEXT:
            message = msgspec.structs.replace(message, **{field: clip(value)})
    return _encoder.encode(message)


def _checked(data: object) -> bytes | bytearray | memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"a control message is bytes, not {type(data).__name__}")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> Message:
    """The message in ``data``; ``ProtocolError`` for anything else (never another exception)."""
    raw = _checked(data)
    try:
        msg: Any = _decoder.decode(raw)
    except Exception as exc:  # DecodeError, ValidationError, and anything unexpected
        raise ProtocolError(f"malformed control message: {exc}") from exc
    return msg  # type: ignore[no-any-return]


def decode_tag(data: bytes) -> Tag:
    """A completion tag; ``ProtocolError`` for anything else."""
    raw = _checked(data)
    try:
        return _tag_decoder.decode(raw)
    except Exception as exc:
        raise ProtocolError(f"malformed completion tag: {exc}") from exc


def decode_note(data: bytes) -> Tag | Ended:
    """What a driver notification carries: a completion tag, or the end of aborted writes
    (the two cannot be mistaken: a tag's second field is a number, an ``Ended``'s a string)."""
    try:
        return decode_tag(data)
    except ProtocolError as exc:
        try:
            return _ended_decoder.decode(data)
        except Exception:
            raise exc from None
