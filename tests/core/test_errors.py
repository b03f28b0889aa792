"""The error family: the first error stays the error, later ones ride along."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import xferkit as xk
import xferkit.errors
from xferkit import (
    ArgumentError,
    BoundsError,
    CapabilityError,
    ManifestError,
    OptionError,
    PlanError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from xferkit.staging import stage
from xferkit.testing.conformance import held
from xferkit.testing.pairs import connected_pair


def test_attach_keeps_the_first_error_and_lists_the_later_ones() -> None:
    err = TransferError("write to peer p failed: link down", subject="p")
    assert str(err) == "write to peer p failed: link down" and err.followups == []
    later = [ValueError("queue flushed"), XferError("retry refused")]
    for e in later:
        err.attach(e)
    assert err.followups == later
    assert err.args[0] == "write to peer p failed: link down"
    assert str(err) == (
        "write to peer p failed: link down (then 2 later error(s) it caused: "
        "ValueError: queue flushed; XferError: retry refused)"
    )
    assert err.subject == "p"


@pytest.mark.parametrize(
    "error",
    [
        BoundsError,
        CapabilityError,
        ManifestError,
        OptionError,
        PlanError,
        PluginError,
        ProtocolError,
        RegistrationError,
        TransferError,
    ],
)
def test_every_error_is_an_xfer_error_and_exported(error: type[XferError]) -> None:
    assert issubclass(error, XferError)
    assert error.__name__ in xk.__all__
    assert error("x", subject=3).subject == 3


def test_an_option_error_is_a_plugin_error() -> None:
    """One error for a bad option across drivers, caught with the plugin errors."""
    assert issubclass(OptionError, PluginError)


DOMAIN_ERRORS = (
    BoundsError,
    CapabilityError,
    ManifestError,
    PlanError,
    ProtocolError,
    RegistrationError,
    TransferError,
    PluginError,
)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[xk.Backend, xk.Backend, xk.Peer, xk.Plan]]:
    src, dst = np.zeros((4, 16), np.uint8), np.zeros((4, 16), np.uint8)
    opener = lambda: xk.open_backend("loopback")  # noqa: E731
    with connected_pair(opener, [src], [dst], src_name="a", dst_name="a") as p:
        yield p.a, p.b, p.peer, xk.plan(held(p.a), p.manifest)


MISUSES: dict[str, Callable[[xk.Backend, xk.Backend, xk.Peer, xk.Plan], object]] = {
    "Backend(object)": lambda a, b, peer, p: xk.Backend(object()),  # type: ignore[arg-type]
    "register(list)": lambda a, b, peer, p: a.register([]),  # type: ignore[arg-type]
    "connect(str, ...)": lambda a, b, peer, p: a.connect("x", peer.manifest),  # type: ignore[arg-type]
    "connect(..., None)": lambda a, b, peer, p: a.connect(b.endpoint(), None),  # type: ignore[arg-type]
    "write(str, ...)": lambda a, b, peer, p: a.write("peer", xk.Descriptors.empty()),  # type: ignore[arg-type]
    "write(peer, None)": lambda a, b, peer, p: a.write(peer, None),  # type: ignore[arg-type]
    "write(notify=str)": lambda a, b, peer, p: a.write(
        peer,
        xk.Descriptors.empty(),
        notify="x",  # type: ignore[arg-type]
    ),
    "write(timeout=str)": lambda a, b, peer, p: a.write(
        peer,
        xk.Descriptors.empty(),
        timeout="1",  # type: ignore[arg-type]
    ),
    "disconnect(str)": lambda a, b, peer, p: a.disconnect("peer"),  # type: ignore[arg-type]
    "plan(None, m)": lambda a, b, peer, p: xk.plan(None, peer.manifest),  # type: ignore[arg-type]
    "coverage(3, m)": lambda a, b, peer, p: xk.coverage(3, peer.manifest),  # type: ignore[arg-type]
    "expand(list)": lambda a, b, peer, p: p.expand([]),  # type: ignore[arg-type]
    "pages(int)": lambda a, b, peer, p: p.pages(3),  # type: ignore[arg-type]
    "Manifest.build(3)": lambda a, b, peer, p: xk.Manifest.build(3),  # type: ignore[arg-type]
    "Manifest.build([3])": lambda a, b, peer, p: xk.Manifest.build([3]),  # type: ignore[list-item]
    "Manifest.decode(str)": lambda a, b, peer, p: xk.Manifest.decode("x"),  # type: ignore[arg-type]
    "open_backend(3)": lambda a, b, peer, p: xk.open_backend(3),  # type: ignore[arg-type]
    "stage(str)": lambda a, b, peer, p: stage("plan", descriptor_bytes=1),  # type: ignore[arg-type]
    "notifications(timeout=str)": lambda a, b, peer, p: a.notifications(timeout="1"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(MISUSES))
def test_a_wrong_argument_type_is_an_argument_error_not_a_domain_error(
    pair: tuple[xk.Backend, xk.Backend, xk.Peer, xk.Plan], call: str
) -> None:
    """Before: a non-Descriptors was a BoundsError, a non-Driver a CapabilityError, a
    non-Manifest a RegistrationError or ProtocolError: caught with the real failures."""
    with pytest.raises(ArgumentError) as info:
        MISUSES[call](*pair)
    assert isinstance(info.value, TypeError) and isinstance(info.value, XferError)
    assert not isinstance(info.value, DOMAIN_ERRORS)


def test_the_error_tree_is_written_down() -> None:
    """errors.py's docstring draws every exported error class."""
    doc = xferkit.errors.__doc__ or ""
    for name in xk.__all__:
        if name.endswith("Error") and name != "RequestError":
            assert name in doc


def test_region_field_errors_name_the_region_by_its_key() -> None:
    """Before: a wrong-typed field had the label string as subject, other checks the key."""
    with pytest.raises(ManifestError) as typed:
        fields: dict[str, Any] = {"addr": 0x1000, "nbytes": 64, "slot_shape": (16,)}
        xk.Region(pool="p", name="a", layer="0", itemsize=4, **fields)  # type: ignore[arg-type]
    assert typed.value.subject == ("p", "a", "0", 0)
    with pytest.raises(ManifestError) as described:
        xk.Region.from_array(object(), pool="p", name="a", layer=1)
    assert described.value.subject == ("p", "a", 1, 0)
    ro = np.zeros((2, 4), np.uint8)
    ro.setflags(write=False)
    with pytest.raises(ManifestError) as readonly:
        xk.Region.from_array(ro, pool="p", name="a", layer=2)
    assert readonly.value.subject == ("p", "a", 2, 0)
