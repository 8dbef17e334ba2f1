"""The join token: what `pdserve up --head` hands to `pdserve join` on other hosts.

`up --head` writes it to a file (mode 0600) beside its state file and prints ``pdserve join
HEAD_ADDRESS --token-file FILE``; the token carries what a joining host needs besides the
head's Ray address: the cluster's Redis URL (with its password), the key prefix, and the
cluster secret (worker/cluster_secret.py: from it the host derives Ray's token, its workers'
TLS certificates and the KV handshake key) or, in a cluster without one, Ray's own token.
It is a credential: copy the file to the hosts that join; never log it
(``PDSERVE_JOIN_TOKEN`` and ``--token`` take the text too, for scripts).

Format: ``pdj1.`` + urlsafe base64 (no padding) of a JSON object.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.worker.cluster_secret import ClusterSecret, write_private_text

TOKEN_PREFIX = "pdj1."


@dataclass(slots=True, frozen=True)
class JoinToken:
    redis_url: str = field(repr=False)  # carries the Redis password
    key_prefix: str
    ray_auth_token: str | None = None  # Ray's own token (no secret); None: none or derived
    secret: str | None = field(default=None, repr=False)  # the cluster secret, text form

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
                secret=fields.get("secret"),
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


def ray_auth_env(token: JoinToken, token_file: Path) -> dict[str, str]:
    """The variables that let this process (and the Ray node it starts) into the cluster.
    With a secret, its Ray token goes to ``token_file`` (mode 0600), never into a variable."""
    if token.secret is not None:
        write_private_text(token_file, ClusterSecret.from_text(token.secret).ray_token())
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    if token.ray_auth_token is not None:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.ray_auth_token}
    return {}
