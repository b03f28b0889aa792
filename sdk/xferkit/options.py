"""A driver's options, declared once as a msgspec Struct and validated by the core.

A driver sets ``Options`` to a subclass of ``DriverOptions``: each field is an
option, its annotation the type (ranges with ``msgspec.Meta``), its default
the default, ``Meta(description=...)`` its documentation. ``open_backend``
converts the caller's keywords through it (llm's ``Model.Options(**options)``),
so an unknown, ill-typed or out-of-range option is an ``OptionError`` naming
it, for every driver, before any engine starts; the driver's ``__init__``
receives the validated Struct.
"""

from __future__ import annotations

import types
import typing
from typing import Any, NamedTuple

import msgspec

from .errors import OptionError


class DriverOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every driver's ``Options``: keyword-only, frozen, unknown fields refused.

    Subclass with ``frozen=True`` (type checkers want it said again).
    """


class OptionInfo(NamedTuple):
    """One documented option: what ``describe`` reads off an ``Options`` Struct."""

    name: str
    type: str
    default: Any
    description: str


def parse(backend: str, options_type: type[DriverOptions], given: dict[str, Any]) -> Any:
    """``given`` as a validated ``options_type``; an ``OptionError`` naming the option otherwise."""
    try:
        return msgspec.convert(given, options_type)
    except msgspec.ValidationError as exc:
        raise OptionError(f"backend {backend!r}: bad option: {exc}", subject=backend) from exc
    except Exception as exc:  # values msgspec cannot read at all (numpy scalars and arrays)
        why = f"{type(exc).__name__}: {exc}"
        raise OptionError(f"backend {backend!r}: bad option: {why}", subject=backend) from exc


def describe(options_type: type[msgspec.Struct]) -> list[OptionInfo]:
    """Every option of ``options_type``: name, type, default (``...``: required), description."""
    out = []
    for f in msgspec.structs.fields(options_type):
        metas = [m for m in getattr(f.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        metas += [
            m
            for arg in typing.get_args(f.type)
            for m in getattr(arg, "__metadata__", ())
            if isinstance(m, msgspec.Meta)
        ]
        description = next((m.description for m in metas if m.description), "")
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = ...
        out.append(OptionInfo(f.name, _type_name(f.type), default, description))
    return out


def _type_name(kind: Any) -> str:
    """An annotation as a reader writes it: ``int``, ``str | None``, ``tuple[str, ...]``."""
    if typing.get_origin(kind) is typing.Annotated:
        return _type_name(typing.get_args(kind)[0])
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(kind))
    if typing.get_origin(kind) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(kind))
    if kind is type(None):
        return "None"
    if typing.get_origin(kind) is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(kind))
        return f"{typing.get_origin(kind).__name__}[{args}]"
    return getattr(kind, "__name__", str(kind))
