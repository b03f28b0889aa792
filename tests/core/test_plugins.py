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
from xferkit import Backend, BackendInfo, OptionError, PluginError, backends, open_backend
from xferkit.driver import CONTRACT_VERSION
from xferkit.options import DriverOptions, describe
from xferkit.plugins import _reset

HEAVY = '''
"""A driver module: importing it is what listing must avoid."""
import msgspec

from xferkit.driver import Capabilities, Done, Driver


class Blob(msgspec.Struct, frozen=True):
    token: str


class FakeDriver(Driver):
    name = "{name}"
    Blob = Blob

    def __init__(self, *, flavour="plain"):
        self.flavour = flavour
        self.capabilities = Capabilities(notifications=False)
        self.address = f"fake-{{flavour}}"

    def register_region(self, region):
        pass

    def deregister_region(self, region):
        pass

    def endpoint(self):
        return Blob(self.address)

    def connect(self, blob, manifest):
        return blob.token

    def post(self, link, descs, notify):
        return Done()


class NotADriver:
    name = "{name}"
'''


def _plugin(specs: str, *, fail: str | None = None, marked: bool = True) -> str:
    """A plugin entry module registering ``specs`` (source of BackendSpec(...) calls).

    ``marked=False`` leaves out ``@hookimpl``: pluggy then sees no hook implementation.
    """
    body = (
        f"raise RuntimeError({fail!r})"
        if fail
        else f"for spec in [{specs}]:\n        register(spec)"
    )
    return (
        "from xferkit.driver import BackendSpec, hookimpl\n\n\n"
        + ("@hookimpl\n" if marked else "")
        + "def register_backends(register):\n"
        + f"    {body}\n"
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


def _install_fake(install: Installer) -> None:
    """Distribution ``fakeplug``: backend ``fake``, a light entry module and a driver module."""
    install.dist(
        "fakeplug",
        {
            "fakeplug_entry": _plugin(
                "BackendSpec(name='fake', target='fakeplug_heavy:FakeDriver')"
            ),
            "fakeplug_heavy": HEAVY.format(name="fake"),
        },
        {"fakeplug": "fakeplug_entry"},
    )


# -- the built-in driver, found like any other ------------------------------------------------


def test_loopback_is_listed_from_its_distribution():
    (info,) = _listed("loopback")
    assert info.distribution == "xferkit-loopback"
    assert info.version == importlib.metadata.version("xferkit-loopback")
    assert info.available and info.reason is None
    assert info.target == "xferkit_loopback.backend:LoopbackDriver"
    with open_backend("loopback", max_batch=7) as b:
        assert isinstance(b, Backend) and type(b.driver).__name__ == "LoopbackDriver"
        assert b.capabilities.max_batch == 7


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
    _install_fake(install)
    (info,) = _listed("fake")
    assert (info.distribution, info.version, info.available) == ("fakeplug", "1.0", True)
    assert "fakeplug_entry" in sys.modules  # discovery did run the plugin
    assert "fakeplug_heavy" not in sys.modules
    with open_backend("fake", flavour="spicy") as b:
        assert isinstance(b, Backend) and b.name == "fake"
        assert type(b.driver) is sys.modules["fakeplug_heavy"].FakeDriver
        assert b.driver.flavour == "spicy"  # type: ignore[attr-defined]
    assert "fakeplug_heavy" in sys.modules
    assert _listed("loopback")[0].available  # the others are still there


def test_probe_reason_makes_a_backend_unavailable(install):
    install.dist(
        "fakeplug-rdma",
        {
            "fakerdma_entry": _plugin(
                "BackendSpec(name='fakerdma', target='fakerdma_heavy:FakeDriver',"
                " probe=lambda: 'libfakeverbs.so.1 missing'),"
                "BackendSpec(name='fakecrash', target='fakerdma_heavy:FakeDriver',"
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
    assert not crash.available and crash.reason and "ZeroDivisionError" in crash.reason


def test_two_plugins_claiming_one_name(install):
    for dist in ("fakeplug-a", "fakeplug-b"):
        mod = dist.replace("-", "_")
        install.dist(
            dist,
            {mod: _plugin(f"BackendSpec(name='twin', target='{mod}_heavy:FakeDriver')")},
            {mod: mod},
        )
    listed = _listed("twin")
    assert [b.distribution for b in listed] == ["fakeplug-a", "fakeplug-b"]
    for info in listed:
        assert not info.available and info.reason
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
    assert not info.available and info.reason
    assert "fakeplug-future" in info.reason
    assert "contract 999" in info.reason and f"speaks {CONTRACT_VERSION}" in info.reason
    with pytest.raises(PluginError, match="contract 999"):
        open_backend("future")


def test_unknown_name_lists_what_is_installed(install):
    _install_fake(install)
    with pytest.raises(PluginError) as exc:
        open_backend("no-such-driver")
    text = str(exc.value)
    assert "'no-such-driver'" in text and "'loopback'" in text and "'fake'" in text
    assert exc.value.subject == "no-such-driver"


BAD_TARGETS = [
    ("badtarget_heavy:NotADriver", "is not a xferkit.driver.Driver subclass"),
    ("badtarget_heavy:FakeDriver", "names itself 'other', not 'bad'"),  # the class's own name
    ("badtarget_heavy:FakeDrvier", "cannot load"),  # a typo in the class
    ("badtarget_hevy:FakeDriver", "cannot load"),  # a typo in the module
]


def _install_bad(install, target: str) -> None:
    install.dist(
        "fakeplug-bad",
        {
            "badtarget_entry": _plugin(f"BackendSpec(name='bad', target={target!r})"),
            "badtarget_heavy": HEAVY.format(name="other"),
        },
        {"bad": "badtarget_entry"},
    )


@pytest.mark.parametrize(("target", "why"), BAD_TARGETS)
def test_target_that_is_not_a_usable_driver(install, target, why):
    _install_bad(install, target)
    assert _listed("bad")[0].available  # the plain listing imports no driver, so cannot know
    with pytest.raises(PluginError, match=why) as exc:
        open_backend("bad")
    assert "fakeplug-bad" in str(exc.value) and target in str(exc.value)


@pytest.mark.parametrize(("target", "why"), BAD_TARGETS)
def test_checked_listing_names_a_target_that_is_not_a_usable_driver(install, target, why):
    _install_bad(install, target)
    (info,) = [b for b in backends(check=True) if b.name == "bad"]
    assert not info.available and info.reason and why in info.reason and target in info.reason
    assert info.distribution == "fakeplug-bad"
    checked = {b.name: b.available for b in backends(check=True)}
    assert checked["loopback"]  # checking imports the good drivers and keeps them usable


def test_cli_check_lists_a_target_that_is_not_a_usable_driver(install, capsys):
    from xferkit.cli import main

    _install_bad(install, "badtarget_heavy:FakeDriver")
    assert main(["backends"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bad ")]
    assert line.endswith("usable") and "unusable" not in line  # unchecked: cannot know
    assert main(["backends", "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if x.startswith("bad ")]
    assert "fakeplug-bad" in line and "unusable:" in line
    assert "names itself 'other', not 'bad'" in line
    (loopback,) = [x for x in out if x.startswith("loopback ")]
    assert loopback.endswith("usable") and "unusable" not in loopback


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
    assert not info.available and info.reason
    assert "fakeplug-broken" in info.reason and "cannot find libbroken" in info.reason
    with pytest.raises(PluginError) as exc:
        open_backend("broken")
    assert "cannot find libbroken" in str(exc.value)
    with open_backend("loopback") as lb:  # one broken plugin does not take the others down
        assert lb.name == "loopback"


def test_plugin_whose_hook_lacks_hookimpl_is_listed_with_the_reason(install, capsys):
    """Without ``@hookimpl`` pluggy sees no implementation: listed, never silently gone."""
    install.dist(
        "fakeplug-unmarked",
        {
            "unmarked_entry": _plugin(
                "BackendSpec(name='unmarked', target='unmarked_heavy:FakeDriver')", marked=False
            ),
            "unmarked_heavy": HEAVY.format(name="unmarked"),
        },
        {"unmarked": "unmarked_entry"},
    )
    info = _only("unmarked")  # listed under its entry-point name: it registered no backend
    assert not info.available and info.reason and info.distribution == "fakeplug-unmarked"
    assert (
        "registered no hook implementation" in info.reason
        and "@xferkit.driver.hookimpl" in info.reason
    )
    assert info.target == "unmarked_entry"
    with pytest.raises(PluginError, match="hookimpl"):
        open_backend("unmarked")
    from xferkit.cli import main

    assert main(["backends"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("unmarked ")]
    assert "unusable:" in line and "@xferkit.driver.hookimpl" in line
    assert _only("loopback").available


def test_plugin_whose_entry_module_fails_to_import_is_listed_unusable(install):
    install.dist(
        "fakeplug-noimport",
        {"noimport_entry": "import mooncake_transfer_engine_not_installed\n"},
        {"noimport": "noimport_entry"},
    )
    info = _only("noimport")
    assert not info.available and info.reason and info.distribution == "fakeplug-noimport"
    assert "mooncake_transfer_engine_not_installed" in info.reason
    assert "ModuleNotFoundError" in info.reason
    with pytest.raises(PluginError, match="mooncake_transfer_engine_not_installed"):
        open_backend("noimport")
    assert _only("loopback").available


def test_reset_forgets_uninstalled_plugins(install):
    """The fixture's cleanup relies on this: after removal and _reset, the plugin is gone."""
    _install_fake(install)
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


# -- options ----------------------------------------------------------------------------------

# What each built-in driver needs to start here (Mooncake over TCP needs no RDMA device).
DRIVER_OPTIONS = {"loopback": {}, "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"}}


@pytest.mark.parametrize("name", ["loopback", "mooncake", "nixl"])
def test_an_unknown_option_is_an_option_error(name: str) -> None:
    info = _only(name)
    if not info.available:
        pytest.skip(f"{name} is not usable here: {info.reason}")
    with pytest.raises(OptionError, match="no_such_option") as exc:
        open_backend(name, **DRIVER_OPTIONS.get(name, {}), no_such_option=1)
    assert name in str(exc.value)
    with open_backend(name, **DRIVER_OPTIONS.get(name, {})) as b:  # the same minus the typo works
        assert b.name == name


def test_an_unknown_option_of_a_third_party_driver_is_an_option_error(install):
    _install_fake(install)
    with pytest.raises(OptionError, match="flavor"):
        open_backend("fake", flavor="spicy")  # the driver spells it "flavour"


@pytest.mark.parametrize("value", [-1, "3", 2.5])
@pytest.mark.parametrize("name", ["loopback", "mooncake", "nixl"])
def test_a_bad_option_value_is_an_option_error(name: str, value: object) -> None:
    """One error type for a bad value across drivers (max_batch: every driver takes it)."""
    info = _only(name)
    if not info.available:
        pytest.skip(f"{name} is not usable here: {info.reason}")
    with pytest.raises(OptionError, match="max_batch"):
        open_backend(name, **DRIVER_OPTIONS.get(name, {}), max_batch=value)


@pytest.mark.parametrize(
    ("options", "culprit"),
    [({"faults": "x"}, "faults"), ({"max_batch": True}, "max_batch"), ({"fautls": None}, "fautls")],
)
def test_loopback_options_are_validated_when_it_opens(options: dict, culprit: str) -> None:
    """Before: open_backend("loopback", faults="x") opened, then register() failed with a
    RegistrationError about a missing attribute."""
    with pytest.raises(OptionError, match=culprit) as exc:
        open_backend("loopback", **options)
    assert exc.value.subject == "loopback"


@pytest.mark.parametrize("name", ["loopback", "mooncake", "nixl"])
def test_every_in_tree_driver_documents_its_options_from_its_struct(name: str) -> None:
    info = _only(name)
    if not info.available:
        pytest.skip(f"{name} is not usable here: {info.reason}")
    module, _, attr = info.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert cls.Options is not None and issubclass(cls.Options, DriverOptions)
    described = describe(cls.Options)
    assert "max_batch" in {o.name for o in described}
    assert all(o.description for o in described)  # each says what it is for
    assert all(o.default is not ... for o in described)  # a driver opens with none given


def test_xferkit_driver_is_the_only_import_a_driver_needs() -> None:
    """Before: the in-tree drivers imported OptionError, ProtocolError, RegistrationError from
    xferkit (xferkit.driver did not re-export them), and hookimpl sat in the engine names."""
    import xferkit
    import xferkit.driver as d

    for name in ("OptionError", "ProtocolError", "RegistrationError", "TransferError"):
        assert getattr(d, name) is getattr(xferkit, name) and name in d.__all__
    assert "hookimpl" in d.__all__ and "hookimpl" not in xferkit.__all__
    for plugin in ("xferkit_loopback", "xferkit_mooncake", "xferkit_nixl"):
        root = Path(importlib.import_module(plugin).__file__ or "").parent
        for source in root.glob("*.py"):
            assert "from xferkit import" not in source.read_text(), source


def test_xferkit_driver_holds_every_error_a_driver_may_raise_or_catch() -> None:
    """Issue 20: ArgumentError, ManifestError and PlanError were only in xferkit."""
    import xferkit.driver as d
    import xferkit.errors as e

    family = {n for n, v in vars(e).items() if isinstance(v, type) and issubclass(v, e.XferError)}
    assert family >= {"ArgumentError", "OptionError", "XferError"}
    for name in family:
        assert getattr(d, name, None) is getattr(e, name) and name in d.__all__, name
    example = Path(importlib.import_module("xferkit_example").__file__ or "").parent
    for source in example.glob("*.py"):
        assert "from xferkit import" not in source.read_text(), source


def test_posted_subclass_slots_mean_something() -> None:
    """Before: ``Posted`` declared no ``__slots__``, so every subclass's were ignored."""
    from xferkit.driver import Done, QueuedBatch

    with pytest.raises(AttributeError):
        Done().anything = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        QueuedBatch(None, b"x").anything = 1  # type: ignore[attr-defined]


def test_a_queued_batch_wakes_every_waiter_once_ended_and_keeps_its_first_outcome() -> None:
    """``block`` waits on a lock held until ``end`` (an Event cost 7 us per small write)."""
    import threading

    from xferkit.driver import QueuedBatch, Status

    batch = QueuedBatch(None, b"x")
    batch.block(0.01)  # pending: returns at the timeout
    assert batch.poll() is Status.PENDING
    woke: list[Status] = []

    def wait() -> None:
        batch.block(30)
        woke.append(batch.poll())

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for w in waiters:
        w.start()
    batch.end("link down")
    batch.end(None)  # a second outcome changes nothing
    for w in waiters:
        w.join(30)
    assert woke == [Status.FAILED] * 3 and batch.error == "link down"
    batch.block(30)  # ended: returns at once, however often asked
    assert batch.poll() is Status.FAILED


# -- messages that say what to fix (issue 20) -------------------------------------------------


def test_an_unknown_name_lists_backend_names_and_the_plugin_that_registered_none(install):
    """A hook left unmarked: its entry-point name cannot be opened, so it is not offered."""
    install.dist(
        "fakeplug-tcp",
        {
            "tcpdriver_entry": _plugin(
                "BackendSpec(name='tcp', target='tcpdriver_heavy:FakeDriver')", marked=False
            ),
            "tcpdriver_heavy": HEAVY.format(name="tcp"),
        },
        {"tcp-driver": "tcpdriver_entry"},
    )
    with pytest.raises(PluginError) as exc:
        open_backend("tcp")
    text = str(exc.value)
    offered = text.split("backends: ", 1)[1].split("]", 1)[0]
    assert "'loopback'" in offered and "tcp-driver" not in offered
    assert "fakeplug-tcp" in text and "registered no" in text and "@xferkit.driver.hookimpl" in text


def test_an_unknown_name_says_which_entry_point_group_xferkit_reads():
    with pytest.raises(PluginError) as exc:
        open_backend("not-installed-anywhere")
    assert "'xferkit' entry-point group" in str(exc.value)
    assert "[project.entry-points.xferkit]" in str(exc.value)


def test_a_target_written_with_a_dot_says_the_form_expected(install):
    install.dist(
        "fakeplug-dotted",
        {
            "dotted_entry": _plugin("BackendSpec(name='dotted', target='dotted_heavy.FakeDriver')"),
            "dotted_heavy": HEAVY.format(name="dotted"),
        },
        {"dotted": "dotted_entry"},
    )
    (info,) = _listed("dotted")
    assert not info.available and info.reason and "'package.module:Class'" in info.reason
    with pytest.raises(PluginError) as exc:
        open_backend("dotted")
    text = str(exc.value)
    assert "'dotted_heavy.FakeDriver'" in text and "'dotted_heavy:FakeDriver'" in text
    assert "fakeplug-dotted" in text
