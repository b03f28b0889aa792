"""The control protocol: every message round-trips; anything else is a ProtocolError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xferkit import ProtocolError
from xferkit.session import wire
from xferkit.testing import msgpack_values, wire_bytes

HELLO = dict(
    version=wire.PROTOCOL_VERSION,
    incarnation=7,
    address="tcp://127.0.0.1:1",
    tp_rank=1,
    tp_size=4,
    fingerprint="abc",
    manifest=b"\x90",
    backend="loopback",
    endpoint=b"e",
    driver_address="1:x",
)
EXAMPLES: list[wire.Message] = [
    wire.Hello(**HELLO),  # type: ignore[arg-type]
    wire.Hello(**HELLO, pokes=True),  # type: ignore[arg-type]
    wire.Welcome(**HELLO, stage="plan", error="no"),  # type: ignore[arg-type]
    wire.Request(rid="r", gen=3, needed=True, slots=wire.pack_slots({"kv": [1, 2]})),
    wire.Abort(rid="r", gen=3, stage="abort", text="why"),
    wire.AbortAck(rid="r", gen=3),
    wire.Fail(rid="r", gen=3, stage="transfer", text="driver said no"),
    wire.Written(rid="r", gen=3, src_rank=0, seq=1, total=2),
    wire.Poke(),
    wire.Ping(incarnation=1),
    wire.Pong(incarnation=2),
    wire.Bye(incarnation=3, reason="closed"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: wire.Message) -> None:
    assert wire.decode(wire.encode(message)) == message


@given(st.sampled_from(EXAMPLES), st.data())
def test_messages_with_random_fields_round_trip_or_are_refused_when_encoded(
    message: wire.Message, data: st.DataObject
) -> None:
    fields = msgspec.structs.asdict(message)
    name = data.draw(st.sampled_from(sorted(fields) or ["unknown"]))  # a Poke has none
    fields[name] = data.draw(msgpack_values(max_leaves=4))
    raw = msgspec.msgpack.encode({"type": type(message).__struct_config__.tag, **fields})
    try:
        got = wire.decode(raw)
    except ProtocolError:
        return
    assert isinstance(got, type(message))
    assert wire.decode(wire.encode(got)) == got


@settings(max_examples=300)
@given(wire_bytes())
def test_random_bytes_decode_to_a_message_or_raise_protocol_error(raw: bytes) -> None:
    try:
        msg = wire.decode(raw)
    except ProtocolError:
        return
    assert isinstance(msg, wire.Message.__args__)  # type: ignore[attr-defined]


@given(wire_bytes())
def test_random_bytes_are_a_tag_or_a_protocol_error(raw: bytes) -> None:
    try:
        tag = wire.decode_tag(raw)
    except ProtocolError:
        return
    assert wire.decode_tag(wire.encode(tag)) == tag


@given(wire_bytes())
def test_random_bytes_are_a_note_or_a_protocol_error(raw: bytes) -> None:
    """What a driver notification carries: a completion tag or an ``Ended``, never both
    readings of one payload, nor another exception."""
    try:
        note = wire.decode_note(raw)
    except ProtocolError:
        return
    assert wire.decode_note(wire.encode(note)) == note


def test_a_tag_and_an_ended_cannot_be_mistaken_for_each_other() -> None:
    ended = wire.Ended("ended", 7)  # a request id that spells the other's tag
    tag = wire.Tag("ended", 7, 0, 1, 0)
    assert wire.decode_note(wire.encode(ended)) == ended
    assert wire.decode_note(wire.encode(tag)) == tag
    with pytest.raises(ProtocolError):
        wire.decode_tag(wire.encode(ended))


def test_unknown_type_wrong_version_field_and_oversize_are_refused() -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode(msgspec.msgpack.encode({"type": "pickle", "x": 1}))
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode(msgspec.msgpack.encode({"type": "ping", "incarnation": -1}))
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (wire.MAX_MESSAGE + 1))
    with pytest.raises(ProtocolError, match="bytes"):
        wire.decode("text")  # type: ignore[arg-type]
    bad = msgspec.msgpack.encode(
        {
            "type": "request",
            "rid": "r",
            "gen": 1,
            "needed": True,
            "slots": {"kv": [2**40]},  # not packed
        }
    )
    with pytest.raises(ProtocolError):
        wire.decode(bad)
