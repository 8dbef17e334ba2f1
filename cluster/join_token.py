"""The join token: what `pdserve up --head` hands to `pdserve join` on other hosts.

`up --head` prints ``pdserve join HEAD_ADDRESS --token TOKEN``; the token carries what a
joining host needs besides the head's Ray address: the cluster's Redis, its key prefix and
the Ray cluster's authentication token. One opaque string, so that whatever else a host
must know to join (a cluster secret) travels the same way without a new flag. It is a
credential: give it on the command line of a trusted host, or through ``PDSERVE_JOIN_TOKEN``.

Format: ``pdj1.`` + urlsafe base64 (no padding) of a JSON object.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

TOKEN_PREFIX = "pdj1."


@dataclass(slots=True, frozen=True)
class JoinToken:
    redis_url: str
    key_prefix: str
    ray_auth_token: str | None = None  # None: the Ray cluster does not use token auth

    def encode(self) -> str:
        raw = json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> JoinToken:
        """ValueError (never echoing the token) when ``text`` is not a join token."""
        text = text.strip()
        if not text.startswith(TOKEN_PREFIX):
            raise ValueError(
                f"not a pdserve join token (it starts with {TOKEN_PREFIX!r}): copy the whole "
                "--token value that `pdserve up --head` printed"
            )
        body = text[len(TOKEN_PREFIX) :]
        try:
            fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return cls(
                redis_url=str(fields["redis_url"]),
                key_prefix=str(fields["key_prefix"]),
                ray_auth_token=fields.get("ray_auth_token"),
            )
        except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                "the join token is damaged (cut short or mistyped?): copy it again from the "
                "output of `pdserve up --head`"
            ) from None


def ray_auth_token() -> str | None:
    """The token of the Ray cluster this process started or joined, where Ray keeps it
    (``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, ``~/.ray/auth_token``);
    None when Ray runs without token authentication."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def ray_auth_env(token: JoinToken) -> dict[str, str]:
    """The variables that let this process (and the Ray node it starts) into the cluster."""
    if token.ray_auth_token is None:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.ray_auth_token}
