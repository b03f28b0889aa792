"""Finding drivers: pluggy hooks over the ``xferkit`` entry-point group.

A plugin module registers ``BackendSpec``s naming its backend class by dotted
path, plus an optional cheap probe; listing backends therefore imports no
driver, and a driver that cannot load here is listed with the reason.
Built-in drivers are discovered exactly like third-party ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

import msgspec
import pluggy

from .backend import CONTRACT_VERSION, Backend
from .errors import PluginError

hookspec = pluggy.HookspecMarker("xferkit")
hookimpl = pluggy.HookimplMarker("xferkit")


class BackendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A backend as a plugin announces it, before anything heavy is imported."""

    name: str
    target: str  # "package.module:Class"
    contract: int = CONTRACT_VERSION
    probe: Callable[[], str | None] | None = None  # None when usable here, else the reason


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


@cache
def _discover() -> tuple[tuple[BackendSpec, str, str], ...]:
    pm = pluggy.PluginManager("xferkit")
    pm.add_hookspecs(_Hooks)
    pm.load_setuptools_entrypoints("xferkit")
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    found: list[tuple[BackendSpec, str, str]] = []
    for impl in pm.hook.register_backends.get_hookimpls():
        dist = dists.get(id(impl.plugin))
        name = dist.project_name if dist else impl.plugin_name
        version = dist.version if dist else "?"
        specs: list[BackendSpec] = []
        try:
            impl.function(register=specs.append)
        except Exception as exc:
            raise PluginError(f"plugin {name} failed while registering backends: {exc}") from exc
        found += [(s, name, version) for s in specs]
    return tuple(found)


def _reset() -> None:
    """Forget discovered plugins (tests that install one at run time)."""
    _discover.cache_clear()


def _problem(spec: BackendSpec, dist: str) -> str | None:
    claims = [d for s, d, _ in _discover() if s.name == spec.name]
    if len(claims) > 1:
        return f"backend name {spec.name!r} is claimed by several plugins: {', '.join(claims)}"
    if spec.contract != CONTRACT_VERSION:
        return (
            f"plugin {dist} implements backend contract {spec.contract}, "
            f"this xferkit speaks {CONTRACT_VERSION}"
        )
    if spec.probe is None:
        return None
    try:
        return spec.probe()
    except Exception as exc:
        return f"probe failed: {type(exc).__name__}: {exc}"


def backends() -> list[BackendInfo]:
    """Every backend plugins announce, usable here or not (and why not)."""
    out = []
    for spec, dist, version in _discover():
        reason = _problem(spec, dist)
        out.append(BackendInfo(spec.name, dist, version, reason is None, reason, spec.target))
    return sorted(out, key=lambda b: (b.name, b.distribution))


def open_backend(name: str, **options: Any) -> Backend:
    """A ready backend by name; ``options`` go to the driver's constructor."""
    matches = [(s, d) for s, d, _ in _discover() if s.name == name]
    if not matches:
        known = sorted({s.name for s, _, _ in _discover()})
        raise PluginError(f"no backend named {name!r}; installed: {known}", subject=name)
    spec, dist = matches[0]
    reason = _problem(spec, dist)
    if reason is not None:
        raise PluginError(f"backend {name!r} ({dist}) is not usable here: {reason}", subject=name)
    module_name, _, attr = spec.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(
            f"backend {name!r} ({dist}): cannot load {spec.target}: {exc}", subject=name
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)) or cls.name != name:
        raise PluginError(
            f"backend {name!r} ({dist}): {spec.target} is not a Backend named {name!r}",
            subject=name,
        )
    return cls(**options)
