"""The error family: the first error stays the error, later ones ride along."""

from __future__ import annotations

import pytest

import xferkit as xk
from xferkit import (
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
