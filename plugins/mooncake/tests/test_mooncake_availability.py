"""Whether xferkit lists mooncake as usable, and why not when it is not."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake is not installed or cannot load")

import xferkit as xk
import xferkit_mooncake


def _mooncake() -> xk.BackendInfo:
    (info,) = [b for b in xk.backends() if b.name == "mooncake"]
    return info


def test_listed_available_here() -> None:
    info = _mooncake()
    assert info.available and info.reason is None
    assert info.distribution == "xferkit-mooncake"
    assert info.target == "xferkit_mooncake.backend:MooncakeDriver"


def test_without_the_module_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "mooncake" else real(name, *args, **kwargs)

    monkeypatch.setattr(xferkit_mooncake.importlib.util, "find_spec", find_spec)
    info = _mooncake()
    assert not info.available
    assert (
        info.reason == "mooncake is not installed (pip install 'xferkit-mooncake[cpu]' or [cuda])"
    )
    with pytest.raises(xk.PluginError, match="mooncake is not installed"):
        xk.open_backend("mooncake", protocol="tcp")


@pytest.mark.parametrize(
    ("library", "command"),
    [
        ("libibverbs.so.1", "apt-get install -y libibverbs1 librdmacm1"),
        ("librdmacm.so.1", "apt-get install -y libibverbs1 librdmacm1"),
        ("libnuma.so.1", "apt-get install -y libnuma1"),
        ("libcurl.so.4", "apt-get install -y libcurl4"),
    ],
)
def test_without_a_system_library_the_reason_is_given(
    monkeypatch: pytest.MonkeyPatch, library: str, command: str
) -> None:
    real = ctypes.CDLL

    def cdll(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == library:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(xferkit_mooncake.ctypes, "CDLL", cdll)
    info = _mooncake()
    assert not info.available
    assert info.reason == f"{library} missing ({command})"


def test_listing_does_not_import_the_driver() -> None:
    code = (
        "import sys, xferkit; xferkit.backends(); "
        "print(sorted(m for m in sys.modules if m.startswith(('mooncake', 'xferkit_mooncake.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
