"""A driver advertising a loopback address under a Session bound beyond this host is refused.

Before (docs/engine.md's example across two hosts): Mooncake opened without
``hostname`` advertised 127.0.0.1, the handshake over the Session's address
succeeded, and every write failed: "send_probe to it returned -102 (ERR_SOCKET:
socket error: the peer's handshake port is unreachable)".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import xferkit as xk
from xferkit.driver import Advertised
from xferkit.reach import bind_host, check_reach, is_loopback
from xferkit.testing import Reference, gdn_hybrid
from xferkit.testing.mock import MockDriver


@pytest.fixture(scope="module")
def mooncake() -> Iterator[xk.Backend]:
    with xk.open_backend("mooncake", protocol="tcp") as backend:  # hostname: 127.0.0.1
        yield backend


@pytest.mark.parametrize("bind", ["tcp://10.77.0.1:0", "tcp://*:5555", "tcp://[::]:0"])
def test_a_loopback_hostname_under_a_wider_bind_is_refused_naming_the_option(
    mooncake: xk.Backend, bind: str
) -> None:
    with pytest.raises(xk.OptionError, match=r"mooncake advertises 127\.0\.0\.1") as err:
        check_reach(mooncake, bind)
    assert err.value.subject == "hostname" and bind in str(err.value)
    wanted = "hostname='10.77.0.1'" if "10.77" in bind else "hostname=<this host's address>"
    assert wanted in str(err.value)


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", "tcp://localhost:9", "ipc:///tmp/xk"])
def test_a_bind_on_this_host_only_needs_no_wider_address(mooncake: xk.Backend, bind: str) -> None:
    check_reach(mooncake, bind)


def test_drivers_advertising_no_host_pass_any_bind() -> None:
    with xk.open_backend("loopback") as loopback, xk.Backend(MockDriver()) as mock:
        for backend in (loopback, mock):
            assert backend.driver.advertised_host() is None
            check_reach(backend, "tcp://10.77.0.1:0")


def test_a_driver_whose_advertised_host_raises_is_a_plugin_error() -> None:
    class Broken(MockDriver):
        def advertised_host(self) -> Advertised | None:
            raise RuntimeError("no address yet")

    with xk.Backend(Broken()) as backend, pytest.raises(xk.PluginError, match="no address yet"):
        check_reach(backend, "tcp://10.77.0.1:0")


def test_what_counts_as_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["10.77.0.1", "0.0.0.0", "*", "node-3", "::"]))
    assert bind_host("tcp://[::1]:5") == "[::1]" and bind_host("ipc:///x") is None


def test_wrong_types_are_argument_errors(mooncake: xk.Backend) -> None:
    with pytest.raises(xk.ArgumentError, match="the backend"):
        check_reach("mooncake", "tcp://10.77.0.1:0")  # type: ignore[arg-type]
    with pytest.raises(xk.ArgumentError, match="the bind address"):
        check_reach(mooncake, None)  # type: ignore[arg-type]


def test_a_session_bound_beyond_this_host_on_a_loopback_driver_refuses_to_start(
    mooncake: xk.Backend,
) -> None:
    """The Session checks at start, before it registers or binds: a refused one holds
    nothing (the same backend then serves a Session bound on this host)."""
    slots = {"kv": 4, "state": 2}
    ref = Reference(gdn_hybrid(), src_tp=1, dst_tp=1, src_slots=slots, dst_slots=slots)
    manifest = ref.srcs[0].manifest
    before = mooncake.manifest
    with pytest.raises(xk.OptionError, match="hostname=<this host's address>") as err:
        xk.Session(mooncake, manifest, bind="tcp://*:0")
    assert err.value.subject == "hostname"
    assert mooncake.manifest == before  # nothing of it was registered
    with xk.Session(mooncake, manifest, bind="tcp://127.0.0.1:0") as session:
        assert session.address.startswith("tcp://127.0.0.1:")
