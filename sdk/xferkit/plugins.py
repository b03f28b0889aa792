"""Finding drivers: pluggy hooks over the ``xferkit`` entry-point group.

A plugin module registers ``BackendSpec``s naming its driver class by dotted
path, plus an optional cheap probe; listing backends therefore imports no
driver, and a driver that cannot load here is listed with the reason.
Built-in drivers are discovered exactly like third-party ones.

Discovery calls each plugin's hook implementation on its own rather than
through ``pm.hook.register_backends(...)``: pluggy's combined call stops at
the first implementation that raises, so one broken plugin would hide every
other; called one by one, the broken one is listed with its error and the
rest still load.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import msgspec
import pluggy

from .arguments import expect
from .backend import Backend
from .driver import CONTRACT_VERSION, BackendSpec, Driver
from .errors import ArgumentError, OptionError, PluginError, XferError
from .options import DriverOptions, parse

hookspec = pluggy.HookspecMarker("xferkit")

__all__ = ["BackendInfo", "accepted_options", "backends", "open_backend"]


class BackendInfo(msgspec.Struct, frozen=True):
    """One line of ``xferkit.backends()``."""

    name: str
    distribution: str
    version: str
    available: bool
    reason: str | None
    target: str


class _Hooks:
    @hookspec
    def register_backends(self, register: Callable[[BackendSpec], None]) -> None:
        """Call ``register(BackendSpec(...))`` once per backend this plugin provides."""


class _Found(NamedTuple):
    spec: BackendSpec
    dist: str
    version: str
    broken: str | None = None  # why the plugin itself could not load


@cache
def _discover() -> tuple[_Found, ...]:
    """Every announced backend; a plugin that fails to load is listed, with why, not fatal."""
    pm = pluggy.PluginManager("xferkit")
    pm.add_hookspecs(_Hooks)
    found: list[_Found] = []
    owners: dict[int, tuple[str, str, str]] = {}  # plugin -> (distribution, version, entry)
    # Each entry point is loaded on its own, under its distribution's name, so that one
    # that fails is named, and two distributions using one entry-point name both load.
    for ep in importlib.metadata.entry_points(group="xferkit"):
        owner = ep.dist.name if ep.dist is not None else ep.name
        version = ep.dist.version if ep.dist is not None else "?"
        try:
            plugin = ep.load()
            if pm.is_registered(plugin):  # one module behind two entry points
                continue
            pm.register(plugin, name=f"{owner}:{ep.name}")
        except Exception as exc:
            why = f"plugin {owner} failed to load ({ep.value}): {type(exc).__name__}: {exc}"
            found.append(_Found(BackendSpec(name=ep.name, target=ep.value), owner, version, why))
            continue
        owners[id(plugin)] = (owner, version, ep.name)
        if not pm.get_hookcallers(plugin):
            why = (
                f"plugin {owner} ({ep.value}) registered no hook implementation: is its "
                "register_backends decorated with @xferkit.driver.hookimpl?"
            )
            found.append(_Found(BackendSpec(name=ep.name, target=ep.value), owner, version, why))
    for impl in pm.hook.register_backends.get_hookimpls():
        owner, version, entry = owners.get(id(impl.plugin), (impl.plugin_name, "?", "?"))
        specs: list[BackendSpec] = []
        try:
            impl.function(register=specs.append)
        except Exception as exc:
            why = f"plugin {owner} failed while registering backends: {type(exc).__name__}: {exc}"
            spec = BackendSpec(name=entry, target=getattr(impl.plugin, "__name__", "?"))
            found.append(_Found(spec, owner, version, why))
            continue
        found += [_Found(s, owner, version) for s in specs]
    return tuple(found)


def _reset() -> None:
    """Forget discovered plugins (tests that install one at run time)."""
    _discover.cache_clear()


def _problem(f: _Found) -> str | None:
    if f.broken is not None:
        return f.broken
    spec = f.spec
    claims = [g.dist for g in _discover() if g.spec.name == spec.name]
    if len(claims) > 1:
        return f"backend name {spec.name!r} is claimed by several plugins: {', '.join(claims)}"
    if ":" not in spec.target:
        module, _, cls = spec.target.rpartition(".")
        fixed = f"{module}:{cls}"
        hint = f"; write {fixed!r}" if module else ""
        return (
            f"plugin {f.dist}: target {spec.target!r} is not of the form "
            f"'package.module:Class' (a colon before the class){hint}"
        )
    if spec.contract != CONTRACT_VERSION:
        return (
            f"plugin {f.dist} implements backend contract {spec.contract}, "
            f"this xferkit speaks {CONTRACT_VERSION}"
        )
    if spec.probe is None:
        return None
    try:
        return spec.probe()
    except Exception as exc:
        return f"probe failed: {type(exc).__name__}: {exc}"


def backends(check: bool = False) -> list[BackendInfo]:
    """Every backend plugins announce, usable here or not (and why not).

    With ``check``, also import each usable driver class and verify it (slower:
    it imports the drivers).
    """
    if not isinstance(check, bool):
        raise ArgumentError(f"backends(check=) takes a bool, not {check!r:.40}")
    out = []
    for f in _discover():
        reason = _problem(f)
        if reason is None and check:
            try:
                _load(f)
            except PluginError as exc:
                reason = str(exc)
        out.append(
            BackendInfo(f.spec.name, f.dist, f.version, reason is None, reason, f.spec.target)
        )
    return sorted(out, key=lambda b: (b.name, b.distribution))


def _load(f: _Found) -> type[Driver]:
    """The driver class a spec names, checked."""
    spec, dist, name = f.spec, f.dist, f.spec.name
    module_name, _, attr = spec.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        raise PluginError(
            f"backend {name!r} ({dist}): cannot load {spec.target}: {type(exc).__name__}: {exc}",
            subject=name,
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise PluginError(
            f"backend {name!r} ({dist}): {spec.target} is not a xferkit.driver.Driver subclass",
            subject=name,
        )
    declared = getattr(cls, "Options", None)
    if declared is not None and not (
        isinstance(declared, type) and issubclass(declared, DriverOptions)
    ):
        raise PluginError(
            f"backend {name!r} ({dist}): {spec.target}.Options is not a "
            "xferkit.options.DriverOptions subclass",
            subject=name,
        )
    if getattr(cls, "name", None) != name:
        raise PluginError(
            f"backend {name!r} ({dist}): {spec.target} names itself "
            f"{getattr(cls, 'name', None)!r}, not {name!r}",
            subject=name,
        )
    return cls


def _unknown(name: str) -> str:
    """Why ``name`` opens nothing: the backend names there are, and plugins that gave none."""
    found = _discover()
    names = sorted({f.spec.name for f in found if f.broken is None})
    text = f"no backend named {name!r}; backends: {names}"
    empty = [f.broken for f in found if f.broken is not None]
    if empty:
        text += f"; {len(empty)} plugin(s) registered no backend: " + "; ".join(empty)
    return (
        f"{text}. xferkit finds plugins in the 'xferkit' entry-point group "
        "([project.entry-points.xferkit] in the plugin's pyproject.toml)"
    )


def accepted_options(name: str) -> frozenset[str]:
    """The option names backend ``name`` takes: its ``Options`` fields, else its ``__init__``
    keywords. Loads the driver class (no engine is opened); ``PluginError`` if it cannot."""
    expect(name, str, "accepted_options() (a backend name)")
    matches = [f for f in _discover() if f.spec.name == name]
    if not matches:
        raise PluginError(_unknown(name), subject=name)
    cls = _load(matches[0])
    if cls.Options is not None:
        return frozenset(cls.Options.__struct_fields__)
    params = inspect.signature(cls).parameters.values()
    keywords = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return frozenset(p.name for p in params if p.kind in keywords)


def open_backend(name: str, /, **options: Any) -> Backend:
    """A ready backend by name, with ``options`` for its driver.

    A driver declaring ``Options`` (every in-tree one) gets them validated here:
    an unknown, ill-typed or out-of-range option is an ``OptionError`` naming it.
    For a driver without, unknown names are refused and the values are its job.
    """
    expect(name, str, "open_backend() (a backend name)")
    matches = [f for f in _discover() if f.spec.name == name]
    if not matches:
        raise PluginError(_unknown(name), subject=name)
    found = matches[0]
    reason = _problem(found)
    if reason is not None:
        raise PluginError(
            f"backend {name!r} ({found.dist}) is not usable here: {reason}", subject=name
        )
    cls = _load(found)
    declared = cls.Options
    args: tuple[Any, ...] = ()
    if declared is not None:  # validated once, here, for every driver that declares them
        args, options = (parse(name, declared, options),), {}
    else:
        try:
            inspect.signature(cls).bind(**options)
        except TypeError as exc:  # an unknown keyword, or a missing one
            raise OptionError(f"backend {name!r}: bad options {sorted(options)}: {exc}") from exc
    try:
        driver = cls(*args, **options)
    except XferError:
        raise
    except Exception as exc:
        raise PluginError(
            f"backend {name!r} failed to start: {type(exc).__name__}: {exc}", subject=name
        ) from exc
    return Backend(driver)
