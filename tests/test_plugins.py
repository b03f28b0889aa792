"""Plugin discovery through real entry points.

Each test installs throwaway distributions at run time: a folder on sys.path
holding ``<name>-<version>.dist-info`` (METADATA + entry_points.txt in the
``xferkit`` group) and the plugin module it points at. Discovery then finds
them exactly as it finds the loopback or a third-party driver from PyPI.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import xferkit
from xferkit import CONTRACT_VERSION, Backend, BackendInfo, PluginError, backends, open_backend
from xferkit.plugins import _reset

HEAVY = '''
"""A driver module: importing it is what listing must avoid."""
from xferkit import Backend, Posted, Status


class Done(Posted):
    def poll(self):
        return Status.DONE

    @property
    def error(self):
        return ""


class Driver(Backend):
    name = "{name}"

    def __init__(self, *, flavour="plain"):
        super().__init__()
        self.flavour = flavour

    def _register_region(self, region):
        pass

    def _deregister_region(self, region):
        pass

    def _endpoint(self):
        return b""

    def _connect(self, blob, manifest):
        return "peer", None

    def _post(self, handle, descs, notify):
        return Done()


class NotABackend:
    name = "{name}"
'''


def _plugin(specs: str, *, fail: str | None = None) -> str:
    """A plugin entry module registering ``specs`` (source of BackendSpec(...) calls)."""
    body = (
        f"raise RuntimeError({fail!r})"
        if fail
        else f"for spec in [{specs}]:\n        register(spec)"
    )
    return (
        "from xferkit import BackendSpec, hookimpl\n\n\n"
        "@hookimpl\n"
        "def register_backends(register):\n"
        f"    {body}\n"
    )


class Installer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: list[str] = []
        self.modules: list[str] = []

    def dist(
        self, dist: str, modules: dict[str, str], entry_points: dict[str, str], version="1.0"
    ) -> None:
        """Install distribution ``dist`` with ``modules`` (name -> source) and entry points."""
        home = self.root / dist
        info = home / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[xferkit]\n{lines}")
        for name, source in modules.items():
            (home / f"{name}.py").write_text(source)
            self.modules.append(name)
        sys.path.insert(0, str(home))
        self.paths.append(str(home))
        importlib.invalidate_caches()
        _reset()


@pytest.fixture
def install(tmp_path: Path) -> Iterator[Installer]:
    installer = Installer(tmp_path)
    yield installer
    for path in installer.paths:
        sys.path.remove(path)
    for name in installer.modules:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    _reset()


def _listed(name: str) -> list[xferkit.BackendInfo]:
    return [b for b in backends() if b.name == name]


# -- the built-in driver, found like any other ------------------------------------------------


def test_loopback_is_listed_from_its_distribution():
    (info,) = _listed("loopback")
    assert info.distribution == "xferkit-loopback"
    assert info.version == importlib.metadata.version("xferkit-loopback")
    assert info.available and info.reason is None
    assert info.target == "xferkit_loopback.backend:LoopbackBackend"
    with open_backend("loopback", max_batch=7) as b:
        assert type(b).__name__ == "LoopbackBackend" and b.capabilities.max_batch == 7


def test_listing_does_not_import_the_loopback_driver():
    """In a fresh interpreter: listing loads the light entry module, not the driver."""
    code = (
        "import sys, xferkit\n"
        "names = [b.name for b in xferkit.backends()]\n"
        "assert 'loopback' in names, names\n"
        "assert 'xferkit_loopback' in sys.modules\n"
        "assert 'xferkit_loopback.backend' not in sys.modules\n"
        "xferkit.open_backend('loopback').close()\n"
        "assert 'xferkit_loopback.backend' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


# -- third-party plugins --------------------------------------------------------------------


def test_listing_does_not_import_targets_and_open_does(install):
    install.dist(
        "fakeplug",
        {
            "fakeplug_entry": _plugin("BackendSpec(name='fake', target='fakeplug_heavy:Driver')"),
            "fakeplug_heavy": HEAVY.format(name="fake"),
        },
        {"fakeplug": "fakeplug_entry"},
    )
    (info,) = _listed("fake")
    assert (info.distribution, info.version, info.available) == ("fakeplug", "1.0", True)
    assert "fakeplug_entry" in sys.modules  # discovery did run the plugin
    assert "fakeplug_heavy" not in sys.modules
    with open_backend("fake", flavour="spicy") as b:
        assert isinstance(b, Backend) and b.flavour == "spicy"
    assert "fakeplug_heavy" in sys.modules
    assert _listed("loopback")[0].available  # the others are still there


def test_probe_reason_makes_a_backend_unavailable(install):
    install.dist(
        "fakeplug-rdma",
        {
            "fakerdma_entry": _plugin(
                "BackendSpec(name='fakerdma', target='fakerdma_heavy:Driver',"
                " probe=lambda: 'libfakeverbs.so.1 missing'),"
                "BackendSpec(name='fakecrash', target='fakerdma_heavy:Driver',"
                " probe=lambda: 1 / 0)"
            ),
            "fakerdma_heavy": HEAVY.format(name="fakerdma"),
        },
        {"fakerdma": "fakerdma_entry"},
        version="2.3.1",
    )
    (info,) = _listed("fakerdma")
    assert (info.distribution, info.version) == ("fakeplug-rdma", "2.3.1")
    assert not info.available and info.reason == "libfakeverbs.so.1 missing"
    with pytest.raises(PluginError, match=r"libfakeverbs\.so\.1 missing") as exc:
        open_backend("fakerdma")
    assert exc.value.subject == "fakerdma" and "fakeplug-rdma" in str(exc.value)
    assert "fakerdma_heavy" not in sys.modules  # an unusable driver is never imported
    (crash,) = _listed("fakecrash")
    assert not crash.available and "ZeroDivisionError" in crash.reason


def test_two_plugins_claiming_one_name(install):
    for dist in ("fakeplug-a", "fakeplug-b"):
        mod = dist.replace("-", "_")
        install.dist(
            dist,
            {mod: _plugin(f"BackendSpec(name='twin', target='{mod}_heavy:Driver')")},
            {mod: mod},
        )
    listed = _listed("twin")
    assert [b.distribution for b in listed] == ["fakeplug-a", "fakeplug-b"]
    for info in listed:
        assert not info.available
        assert "fakeplug-a" in info.reason and "fakeplug-b" in info.reason
    with pytest.raises(PluginError) as exc:
        open_backend("twin")
    assert "fakeplug-a" in str(exc.value) and "fakeplug-b" in str(exc.value)
    assert _listed("loopback")[0].available


def test_an_entry_point_name_shared_with_a_builtin_hides_nothing(install):
    """Entry-point names are per distribution: a third party's "loopback" entry is its own."""
    install.dist(
        "thirdparty-fast",
        {"thirdparty_fast": _plugin("BackendSpec(name='fast', target='thirdparty_fast:D')")},
        {"loopback": "thirdparty_fast"},
    )
    names = {(b.name, b.distribution) for b in backends()}
    assert {("fast", "thirdparty-fast"), ("loopback", "xferkit-loopback")} <= names
    assert _listed("loopback")[0].available


def test_plugin_for_another_contract_version(install):
    install.dist(
        "fakeplug-future",
        {"future_entry": _plugin("BackendSpec(name='future', target='x:Y', contract=999)")},
        {"future": "future_entry"},
    )
    (info,) = _listed("future")
    assert not info.available
    assert "fakeplug-future" in info.reason
    assert "contract 999" in info.reason and f"speaks {CONTRACT_VERSION}" in info.reason
    with pytest.raises(PluginError, match="contract 999"):
        open_backend("future")


def test_unknown_name_lists_what_is_installed(install):
    install.dist(
        "fakeplug",
        {"fakeplug_entry": _plugin("BackendSpec(name='fake', target='fakeplug_heavy:Driver')")},
        {"fakeplug": "fakeplug_entry"},
    )
    with pytest.raises(PluginError) as exc:
        open_backend("no-such-driver")
    text = str(exc.value)
    assert "'no-such-driver'" in text and "'loopback'" in text and "'fake'" in text
    assert exc.value.subject == "no-such-driver"


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("badtarget_heavy:NotABackend", "is not a Backend"),
        ("badtarget_heavy:Driver", "is not a Backend named 'bad'"),  # it is named 'other'
        ("badtarget_heavy:Missing", "cannot load"),
        ("badtarget_nowhere:Driver", "cannot load"),
    ],
)
def test_target_that_is_not_a_usable_backend(install, target, why):
    install.dist(
        "fakeplug-bad",
        {
            "badtarget_entry": _plugin(f"BackendSpec(name='bad', target={target!r})"),
            "badtarget_heavy": HEAVY.format(name="other"),
        },
        {"bad": "badtarget_entry"},
    )
    assert _listed("bad")[0].available  # listing cannot know without importing
    with pytest.raises(PluginError, match=why) as exc:
        open_backend("bad")
    assert "fakeplug-bad" in str(exc.value) and target in str(exc.value)


def _only(name: str) -> BackendInfo:
    (info,) = [b for b in backends() if b.name == name]
    return info


def test_plugin_whose_hook_raises_is_listed_unusable_and_others_still_work(install):
    install.dist(
        "fakeplug-broken",
        {"broken_entry": _plugin("", fail="cannot find libbroken")},
        {"broken": "broken_entry"},
    )
    info = _only("broken")
    assert not info.available
    assert "fakeplug-broken" in info.reason and "cannot find libbroken" in info.reason
    with pytest.raises(PluginError) as exc:
        open_backend("broken")
    assert "cannot find libbroken" in str(exc.value)
    with open_backend("loopback") as lb:  # one broken plugin does not take the others down
        assert lb.name == "loopback"


def test_plugin_whose_entry_module_fails_to_import_is_listed_unusable(install):
    install.dist(
        "fakeplug-noimport",
        {"noimport_entry": "import mooncake_transfer_engine_not_installed\n"},
        {"noimport": "noimport_entry"},
    )
    info = _only("noimport")
    assert not info.available and info.distribution == "fakeplug-noimport"
    assert "mooncake_transfer_engine_not_installed" in info.reason
    assert "ModuleNotFoundError" in info.reason
    with pytest.raises(PluginError, match="mooncake_transfer_engine_not_installed"):
        open_backend("noimport")
    assert _only("loopback").available


def test_reset_forgets_uninstalled_plugins(install):
    """The fixture's cleanup relies on this: after removal and _reset, the plugin is gone."""
    install.dist(
        "fakeplug",
        {"fakeplug_entry": _plugin("BackendSpec(name='fake', target='fakeplug_heavy:Driver')")},
        {"fakeplug": "fakeplug_entry"},
    )
    assert _listed("fake")
    sys.path.remove(install.paths.pop())
    assert _listed("fake")  # cached until reset
    _reset()
    assert not _listed("fake") and _listed("loopback")


def test_cli_lists_backends(capsys):
    from xferkit.cli import main

    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (loopback,) = [line for line in lines if line.startswith("loopback ")]
    assert "xferkit-loopback" in loopback and loopback.endswith("usable")
    assert len(lines) == len(backends())
