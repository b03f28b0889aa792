"""CurveZMQ keys for a Session: its own pair and the public keys it trusts.

Files are pyzmq's certificate format (``zmq.auth.create_certificates`` /
``load_certificate``), which ``xferkit keygen DIR`` writes. A deployment
either shares one pair (every rank trusts its own public key) or gives each
rank its pair and a directory of the public keys it trusts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import zmq
import zmq.auth

from ..errors import XferError

KEY_LEN = 40  # a Z85-encoded Curve25519 key


def _key(value: object, what: str) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if not isinstance(raw, bytes) or len(raw) != KEY_LEN:
        raise XferError(f"{what} must be a {KEY_LEN}-character Z85 Curve key, not {value!r}")
    try:
        zmq.utils.z85.decode(raw)
    except Exception as exc:
        raise XferError(f"{what} is not valid Z85: {exc}") from None
    return raw


class SessionKeys:
    """A Curve key pair and the public keys of the peers this session accepts."""

    __slots__ = ("public", "secret", "trusted")

    def __init__(self, public: bytes | str, secret: bytes | str, trusted: Iterable[bytes | str]):
        self.public = _key(public, "public key")
        self.secret = _key(secret, "secret key")
        self.trusted = frozenset(_key(k, "trusted key") for k in trusted)
        if not self.trusted:
            raise XferError("SessionKeys needs at least one trusted public key")

    def __repr__(self) -> str:  # never print the secret
        return f"SessionKeys(public={self.public.decode()!r}, {len(self.trusted)} trusted)"

    @classmethod
    def generate(cls) -> SessionKeys:
        """A fresh pair that trusts only itself (the shared-pair case, and tests)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret, [public])

    @classmethod
    def from_files(
        cls, secret_file: str | os.PathLike[str], trusted: Iterable[str | os.PathLike[str]] = ()
    ) -> SessionKeys:
        """Load ``secret_file`` (a ``.key_secret`` certificate) and the trusted public keys.

        Each entry of ``trusted`` is a certificate file or a directory of them;
        with none, the session trusts its own public key (one shared pair).
        """
        public, secret = _load(Path(secret_file))
        if secret is None:
            raise XferError(f"{secret_file}: no secret key in this certificate")
        keys: list[bytes] = []
        for entry in trusted:
            path = Path(entry)
            files = (
                sorted(p for p in path.iterdir() if p.suffix == ".key") if path.is_dir() else [path]
            )
            keys += [_load(f)[0] for f in files]
        return cls(public, secret, keys or [public])

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SessionKeys | None:
        """Keys named by ``XFERKIT_SECRET_KEY_FILE`` and ``XFERKIT_TRUSTED_KEYS`` (paths joined
        by ``os.pathsep``); None when the first is unset."""
        env = os.environ if env is None else env
        secret = env.get("XFERKIT_SECRET_KEY_FILE")
        if not secret:
            return None
        trusted = [p for p in env.get("XFERKIT_TRUSTED_KEYS", "").split(os.pathsep) if p]
        return cls.from_files(secret, trusted)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise XferError(f"cannot load Curve certificate {path}: {exc}") from None
    return public, secret


def keygen(directory: str | os.PathLike[str], name: str = "xferkit") -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (secret, mode 0600) in ``directory``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(path, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)
