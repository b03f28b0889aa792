"""A Session's settings from a mapping, a JSON or TOML file, and ``XFERKIT_*`` variables.

The shape of vLLM's ``kv_transfer_config``: one flat table naming the driver
and its options beside the Session's own settings, so a deployment states
all of it in one place::

    {"backend": "mooncake", "backend_options": {"protocol": "tcp"},
     "bind": "tcp://10.0.0.5:7000", "request_timeout_s": 30}

Every field of ``SessionConfig`` may also come from the environment as
``XFERKIT_`` and the field's name in capitals (``XFERKIT_DEAD_AFTER_S=8``;
``XFERKIT_BACKEND_OPTIONS`` holds JSON, ``XFERKIT_TRUSTED_KEYS`` paths joined by
``os.pathsep``), which wins over the file: the usual order for containers.
Types are checked here, by msgspec, with the field named; ranges and how
settings relate are the Session's to check, as for any caller.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from ..backend import Backend
from ..errors import ArgumentError, XferError
from ..manifest import Manifest
from ..plugins import open_backend
from .keys import SessionKeys

PREFIX = "XFERKIT_"


class SessionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``Session.from_config`` needs besides the manifest (defaults: Session's)."""

    backend: str = "loopback"
    backend_options: dict[str, Any] = msgspec.field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:0"
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0
    handshake_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    lease_s: float = 30.0
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 2.0
    group: str | None = None
    pp_rank: int = 0
    pp_size: int = 1
    staging: Literal["auto", "always", "never"] = "auto"
    staging_bytes: int = 64 << 20
    staging_slice_bytes: int = 16 << 20
    secret_key_file: str | None = None  # CurveZMQ: this rank's secret certificate
    trusted_keys: list[str] = msgspec.field(default_factory=list)  # files or directories

    def session_kwargs(self) -> dict[str, Any]:
        """The Session's keyword arguments (the backend and the keys are opened apart)."""
        skip = {"backend", "backend_options", "secret_key_file", "trusted_keys"}
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in skip}


FIELDS = SessionConfig.__struct_fields__


def load_config(
    source: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> SessionConfig:
    """The settings in ``source`` (a mapping, or a ``.json``/``.toml`` file), with every
    ``XFERKIT_*`` variable of ``env`` (``os.environ`` if None) over them. An unknown field, a
    value of the wrong type or a file that cannot be read is an ``XferError`` naming it."""
    if source is None:
        raw: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, str | os.PathLike):
        raw = _read(Path(source))
    else:
        raise ArgumentError(
            f"load_config() takes a mapping or a path, not {source!r}", subject=source
        )
    where = "config" if source is None or isinstance(source, Mapping) else str(source)
    env = os.environ if env is None else env
    if not isinstance(env, Mapping):
        raise ArgumentError(f"load_config(env=) takes a mapping of variables, not {env!r:.80}")
    named = {name: env[PREFIX + name.upper()] for name in FIELDS if PREFIX + name.upper() in env}
    for name, text in named.items():
        if not isinstance(text, str):
            raise ArgumentError(f"{PREFIX}{name.upper()} must be a str, not {text!r:.80}")
    raw.update({name: _from_env(name, text) for name, text in named.items()})
    if named:
        where += f" with {', '.join(PREFIX + n.upper() for n in named)}"
    try:
        return msgspec.convert(raw, SessionConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise XferError(f"{where}: {exc}", subject=where) from None


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:  # tomllib's and json's: ValueErrors
        raise XferError(f"{path}: cannot read the config: {exc}", subject=str(path)) from None
    if not isinstance(data, dict):
        raise XferError(f"{path}: the config must be a table, not {type(data).__name__}")
    return data


def _from_env(name: str, text: str) -> Any:
    if name == "backend_options":
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as exc:  # nested past the interpreter's depth
            raise XferError(f"{PREFIX}BACKEND_OPTIONS is not JSON: {exc}") from None
    if name == "trusted_keys":
        return [p for p in text.split(os.pathsep) if p]
    if name == "group" and not text:
        return None
    return text


S = TypeVar("S")


def open_session(
    cls: Callable[..., S],
    manifest: Manifest,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    backend: Backend | None = None,
    on_finished: Callable[[Any], None] | None = None,
    on_pair: Callable[[Any], None] | None = None,
) -> S:
    """``Session.from_config``: its backend opened from ``backend`` and ``backend_options``
    unless one is given, its keys from ``secret_key_file`` and ``trusted_keys``; a backend
    opened here is closed again if the Session is refused."""
    if not isinstance(manifest, Manifest):
        raise ArgumentError(f"from_config() needs a Manifest, not {manifest!r}", subject=manifest)
    c = load_config(config, env)
    keys = None
    if c.secret_key_file is not None:
        keys = SessionKeys.from_files(c.secret_key_file, c.trusted_keys)
    opened = open_backend(c.backend, **c.backend_options) if backend is None else None
    try:
        return cls(
            backend or opened, manifest, keys=keys, on_finished=on_finished, on_pair=on_pair,
            **c.session_kwargs(),
        )  # fmt: skip
    except BaseException:
        if opened is not None:
            opened.close()
        raise
