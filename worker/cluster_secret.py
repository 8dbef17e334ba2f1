"""The cluster secret: one random value that every credential inside a cluster derives from.

Whoever holds it is a member: it can serve or call the worker gRPC API (mutual TLS, certificates
issued by a CA derived from it: worker/mutual_tls.py), send KV blocks to a worker (the KV
handshake key), use Redis (its password) and Ray (its token). Each use gets its own key,
``HMAC-SHA256(secret, "pdserve/" + purpose)``, so one credential leaking (a Redis password
in a URL) reveals neither the secret nor the others.

Text form (files, join tokens): ``pdserve-secret-v1:`` + the 32 bytes in unpadded base64url.
A secret file must be readable by its owner only (mode 0600), as ssh insists for private
keys. Nothing here logs the value, and ``repr`` hides it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

SECRET_BYTES = 32
TEXT_PREFIX = "pdserve-secret-v1:"


@dataclass(slots=True, frozen=True)
class ClusterSecret:
    """The secret value (hidden from ``repr``) and the keys derived from it."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) != SECRET_BYTES:
            raise ValueError(f"a cluster secret is {SECRET_BYTES} bytes, got {len(self.value)}")

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_text(cls, text: str) -> ClusterSecret:
        """Parse the text form; ValueError that never quotes the text (it may be a secret)."""
        text = text.strip()
        if not text.startswith(TEXT_PREFIX):
            raise ValueError(f"not a pdserve cluster secret: it must start with {TEXT_PREFIX!r}")
        encoded = text[len(TEXT_PREFIX) :]
        try:
            value = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except (binascii.Error, ValueError) as err:
            raise ValueError("the cluster secret is not valid base64url") from err
        return cls(value)

    def to_text(self) -> str:
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.value).decode().rstrip("=")

    def derive(self, purpose: str) -> bytes:
        """32 bytes for one purpose; different purposes give independent keys."""
        return hmac.new(self.value, f"pdserve/{purpose}".encode(), hashlib.sha256).digest()

    def kv_transfer_key(self) -> bytes:
        return self.derive("kv-transfer")

    def tls_ca_seed(self) -> bytes:
        return self.derive("tls-ca")

    def redis_password(self) -> str:
        return self.derive("redis-password").hex()

    def ray_token(self) -> str:
        return self.derive("ray-token").hex()


def write_secret_file(path: Path, secret: ClusterSecret) -> None:
    """Write ``secret`` to ``path`` with mode 0600."""
    write_private_text(path, secret.to_text() + "\n")


def write_private_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, mode 0600 from its creation (never readable by others,
    not even for a moment) and atomically (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: the mode is ours, not a leftover file's
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)


def read_secret_file(path: Path) -> ClusterSecret:
    """The secret in ``path``; ValueError when it is missing, malformed or readable by others."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as err:
        raise ValueError(f"cluster secret file {path} does not exist") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"cluster secret file {path} is accessible by group or others (mode "
            f"{stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    try:
        return ClusterSecret.from_text(path.read_text())
    except ValueError as err:
        raise ValueError(f"cluster secret file {path}: {err}") from err
