"""Endpoints and connections: the core's envelope, blob decoding, reference counts, staleness."""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec
import pytest
from mock_pairs import buffer, descs, forged, manifest, mock, mock_pair, posted

from xferkit import (
    ArgumentError,
    Backend,
    CapabilityError,
    ProtocolError,
    RegistrationError,
    Status,
    TransferError,
    XferError,
)
from xferkit.driver import CONTRACT_VERSION
from xferkit.testing.mock import STALL, Call, MockDriver


def test_endpoint_before_register_is_refused() -> None:
    driver = MockDriver()
    with Backend(driver) as b:
        with pytest.raises(RegistrationError, match="before register"):
            b.endpoint()
        b.register(manifest([buffer(64, 1)], "x"))
        b.endpoint()
        b.deregister()
        with pytest.raises(RegistrationError, match="before register"):
            b.endpoint()  # nothing registered any more: nothing to describe
        assert len(driver.of("endpoint")) == 1  # the driver was asked only when registered


def test_a_peer_is_named_after_the_remote_backend_and_its_address() -> None:
    with mock_pair() as pair:
        assert pair.peer.name == f"mock:{pair.b.driver.address}"
        assert pair.peer.backend == "mock"
        assert pair.peer.manifest is pair.b.manifest
        assert repr(pair.peer) == f"Peer('mock:{pair.b.driver.address}', 1 regions)"


def test_malformed_or_foreign_endpoints_are_protocol_errors() -> None:
    with mock_pair() as pair:
        a, m = pair.a, pair.b.manifest
        assert m is not None
        good = pair.b.endpoint()
        with pytest.raises(ProtocolError, match="malformed"):
            a.connect(b"certainly not an endpoint", m)
        with pytest.raises(ProtocolError, match="malformed"):
            a.connect(msgspec.msgpack.encode({"backend": "mock"}), m)
        with pytest.raises(ArgumentError, match="not str"):
            a.connect(good.decode("latin-1"), m)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError) as info:
            a.connect(forged(good, backend="loopback"), m)
        assert "mock" in str(info.value) and "loopback" in str(info.value)
        with pytest.raises(ProtocolError, match=f"contract {CONTRACT_VERSION + 1}"):
            a.connect(forged(good, contract=CONTRACT_VERSION + 1), m)
        with pytest.raises(ArgumentError, match="the peer's manifest"):
            a.connect(good, None)  # type: ignore[arg-type]
        assert len(pair.driver.of("connect")) == 1  # only the pair's own connect


@pytest.mark.parametrize(
    "blob", [{"address": 5}, {}, {"address": ["mock-1"]}, [1, 2], "mock-1", None, 7]
)
def test_a_valid_envelope_around_a_garbage_blob_is_a_protocol_error(blob: Any) -> None:
    with mock_pair() as pair:
        assert pair.b.manifest is not None
        fields = msgspec.msgpack.decode(pair.b.endpoint())
        fields["blob"] = blob
        with pytest.raises(ProtocolError, match="malformed endpoint blob") as info:
            pair.a.connect(msgspec.msgpack.encode(fields), pair.b.manifest)
        assert pair.b.driver.address in str(info.value)
        assert not isinstance(info.value, msgspec.ValidationError)
        assert len(pair.driver.of("connect")) == 1  # the driver never saw it


@pytest.mark.parametrize(
    "where", [(socket.gethostname(), os.getpid() + 1), ("elsewhere.invalid", os.getpid())]
)
def test_an_endpoint_of_another_process_needs_cross_process(where: tuple[str, int]) -> None:
    host, pid = where
    with mock_pair() as pair:  # the mock works within one process only
        assert pair.b.manifest is not None
        with pytest.raises(CapabilityError) as info:
            pair.a.connect(forged(pair.b.endpoint(), host=host, pid=pid), pair.b.manifest)
        assert str(pid) in str(info.value) and host in str(info.value)
        assert len(pair.driver.of("connect")) == 1  # only the pair's own


def test_driver_exceptions_while_connecting_are_xfer_errors() -> None:
    refusal = ConnectionRefusedError("no route to host")
    refuse = [True]

    def handler(call: Call) -> None:
        if call.op in ("connect", "endpoint") and refuse:
            raise refusal

    with Backend(MockDriver(handler)) as a, Backend(MockDriver(handler)) as b:
        a.register(manifest([buffer(64, 0)], "src"))
        b.register(manifest([buffer(64, 1)], "dst"))
        with pytest.raises(TransferError, match="building the endpoint failed") as info:
            b.endpoint()
        assert info.value.__cause__ is refusal
        refuse.clear()
        endpoint = b.endpoint()
        refuse.append(True)
        assert b.manifest is not None
        with pytest.raises(TransferError, match="no route to host") as info:
            a.connect(endpoint, b.manifest)
        assert info.value.__cause__ is refusal
        assert info.value.subject == f"mock:{b.driver.address}"
        refuse.clear()
        peer = a.connect(endpoint, b.manifest)  # nothing was left half-connected
        assert len(mock(a).of("connect")) == 2
        assert a.manifest is not None
        a.write(peer, descs([a.manifest.addrs[0]], [b.manifest.addrs[0]], [8])).wait(5)


def test_connections_to_one_remote_are_reference_counted() -> None:
    with mock_pair() as pair:
        a, driver = pair.a, pair.driver
        assert pair.b.manifest is not None
        second = a.connect(pair.b.endpoint(), pair.b.manifest)
        assert second is not pair.peer and second.name == pair.peer.name
        assert len(driver.of("connect")) == 1  # one driver connection for both
        a.disconnect(pair.peer)
        assert driver.of("disconnect") == []  # the second still uses it
        a.write(second, pair.descs(2, 64)[0]).wait(5)
        a.disconnect(second)
        assert [c.link for c in driver.of("disconnect")] == [pair.b.driver.address]
        a.disconnect(second)  # again: nothing more to do
        assert len(driver.of("disconnect")) == 1
        with pytest.raises(TransferError, match="not connected"):
            a.write(second, pair.descs(2, 64)[0])


def test_a_changed_blob_for_the_same_address_makes_old_peers_stale() -> None:
    with mock_pair() as pair:
        a, driver, m = pair.a, pair.driver, pair.b.manifest
        assert m is not None
        address = pair.b.driver.address
        endpoint = pair.b.endpoint()
        other = a.connect(endpoint, m)  # a second peer on the first connection
        renewed = forged(endpoint, blob={"address": address, "epoch": 2})  # re-registered
        fresh = a.connect(renewed, m)
        assert len(driver.of("connect")) == 2
        assert len(driver.of("disconnect")) == 1  # the old connection went with its users
        copies, want = pair.descs(4, 64)
        for stale in (pair.peer, other):
            with pytest.raises(TransferError, match="stale") as info:
                a.write(stale, copies)
            assert info.value.subject == stale.name
        assert posted(a) == []
        a.write(fresh, copies).wait(5)
        assert (pair.dst == want).all()
        assert a.connect(renewed, m).name == fresh.name  # the same blob again: shared
        assert len(driver.of("connect")) == 2
        a.disconnect(pair.peer)
        a.disconnect(other)
        assert len(driver.of("disconnect")) == 1  # stale peers hold no connection


def test_a_retired_connection_ends_its_transfers_before_the_driver_disconnects() -> None:
    """The driver is promised no transfer runs on a connection it is told to forget."""
    transfers: list[Any] = []
    seen: list[Status] = []

    def handler(call: Call) -> str | None:
        if call.op == "post":
            return STALL
        if call.op == "disconnect":
            seen.extend(t.poll() for t in transfers)
        return None

    with mock_pair(handler) as pair:
        assert pair.b.manifest is not None
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        transfers.append(t)
        renewed = forged(pair.b.endpoint(), blob={"address": pair.b.driver.address, "n": 1})
        pair.a.connect(renewed, pair.b.manifest)
        assert seen == [Status.FAILED]
        assert t.error is not None and "stale" in str(t.error)


def test_disconnect_ends_that_peers_transfers_first_and_only_those() -> None:
    transfers: list[Any] = []
    seen: list[list[Status]] = []

    def handler(call: Call) -> str | None:
        if call.op == "post":
            return STALL
        if call.op == "disconnect":
            seen.append([t.poll() for t in transfers])
        return None

    with mock_pair(handler) as pair, Backend(MockDriver()) as c:
        c.register(manifest([buffer(4096, 5)], "dst"))
        assert c.manifest is not None and pair.b.manifest is not None
        other = pair.a.connect(c.endpoint(), c.manifest)
        src = pair.src.ctypes.data
        transfers.append(pair.a.write(pair.peer, pair.descs(2, 64)[0]))
        transfers.append(pair.a.write(other, descs([src], [c.manifest.regions[0].addr], [8])))
        pair.a.disconnect(pair.peer)
        assert seen == [[Status.FAILED, Status.PENDING]]
        assert "disconnected" in str(transfers[0].error)
        assert transfers[1].poll() is Status.PENDING


def test_writes_to_peers_this_backend_does_not_hold_are_refused() -> None:
    with mock_pair() as pair, mock_pair() as third:
        copies, _ = pair.descs(1, 64)
        with pytest.raises(TransferError, match="not connected"):
            pair.a.write(third.peer, copies)  # another backend's peer
        with pytest.raises(ArgumentError, match="takes a Peer"):
            pair.a.write("mock:x", copies)  # type: ignore[arg-type]
        pair.a.disconnect(pair.peer)
        with pytest.raises(XferError, match="not connected"):
            pair.a.write(pair.peer, copies)
        assert posted(pair.a) == [] and posted(third.a) == []
