"""Whether a driver's advertised address reaches as far as the Session's bind.

A driver whose engine is told a host name (Mooncake's ``hostname``, default
127.0.0.1) advertises it to every peer. A Session bound to a non-loopback
address is reachable from other hosts, so their handshakes succeed, and then
every write fails at the driver ("send_probe ... the peer's handshake port is
unreachable"). ``check_reach`` turns that into a refusal at start, naming the
option to set; a driver says what it advertises through ``Driver.advertised_host``.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, NamedTuple

from .arguments import expect
from .errors import OptionError, PluginError

if TYPE_CHECKING:
    from .backend import Backend

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", ""})


class Advertised(NamedTuple):
    """What a driver tells peers to reach it at, and the ``open_backend`` option setting it."""

    host: str
    option: str


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1; a host name other than localhost is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_host(bind: str) -> str | None:
    """The host of a ``tcp://host:port`` bind; None for ``ipc://`` (one host by nature)."""
    if not bind.startswith("tcp://"):
        return None
    return bind.removeprefix("tcp://").rpartition(":")[0]


def check_reach(backend: Backend, bind: str) -> None:
    """``OptionError`` when ``bind`` reaches beyond this host but the driver advertises a
    loopback address; the message names the option and the value to give it."""
    from .backend import Backend  # the backend imports the driver contract, which imports us

    expect(backend, Backend, "check_reach() (the backend)")
    expect(bind, str, "check_reach() (the bind address)")
    host = bind_host(bind)
    if host is None or is_loopback(host):
        return
    try:
        advertised = backend.driver.advertised_host()
    except Exception as exc:
        raise PluginError(
            f"{backend.name}: advertised_host() failed: {type(exc).__name__}: {exc}",
            subject=backend.name,
        ) from exc
    if advertised is None or not is_loopback(advertised.host):
        return
    bare = host.strip("[]")
    value = "<this host's address>" if bare in _WILDCARDS else repr(bare)
    raise OptionError(
        f"{backend.name} advertises {advertised.host} to its peers (option "
        f"{advertised.option!r}), but the Session binds {bind}: peers on other hosts would "
        f"pair with it and then fail every write; open it with "
        f"open_backend({backend.name!r}, {advertised.option}={value}, ...)",
        subject=advertised.option,
    )
