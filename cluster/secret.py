"""The cluster secret of `pdserve up`: where it comes from, and what it secures.

::

    pdserve up                          a new secret per start, in a file beside the state
                                        file (up.json -> up.secret, mode 0600), removed on exit
    --cluster-secret-file F             the secret in F (PDSERVE_CLUSTER_SECRET_FILE too),
                                        made there if F does not exist; kept: other hosts
                                        and later starts use the same one
    --no-cluster-auth                   none: plaintext worker gRPC, open KV ports, Redis
                                        without a password

With a secret (worker/cluster_secret.py derives one credential per use from it):

* the embedded redis-server requires its Redis password; every client gets it inside the
  Redis URL (an external ``--redis-url`` brings its own credentials and TLS, ``rediss://``);
* a local Ray cluster that `pdserve up` starts uses token authentication with the secret's
  Ray token, read from a 0600 file beside the state file (``RAY_AUTH_TOKEN_PATH``: the
  token is never in a variable or on a command line), so a host holding the secret derives
  the same token;
* workers get the secret in memory: mutual TLS on their gRPC port, authenticated KV;
* routers get a client certificate for their worker channels.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.worker.cluster_secret import (
    ClusterSecret,
    read_secret_file,
    write_private_text,
    write_secret_file,
)

log = logging.getLogger("pdserve.up")

# Ray's own variables: a user who set any of them chose Ray's authentication already.
_RAY_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass(slots=True, frozen=True)
class SecretSource:
    """Where `pdserve up` gets its secret: ``path``, read if ``given``, else written anew;
    and where the Ray token goes (beside the state file, a directory `pdserve up` writes)."""

    path: Path
    given: bool
    ray_token_file: Path


def secret_source(secret_file: Path | None, state_file: Path) -> SecretSource:
    """The given file, else a new secret beside the state file (``up.json`` -> ``up.secret``)."""
    path = secret_file or state_file.with_suffix(".secret")
    return SecretSource(path, secret_file is not None, state_file.with_suffix(".ray-token"))


@contextlib.contextmanager
def cluster_secret(source: SecretSource | None) -> Iterator[ClusterSecret | None]:
    """The secret for the ``with`` block (None without a source). A given file is read, or
    made when it does not exist, and kept; a file of our own is removed at the end."""
    if source is None:
        log.warning(
            "cluster authentication is off: whoever reaches a worker or Redis port can use it"
        )
        yield None
        return
    if source.given and source.path.exists():
        yield read_secret_file(source.path)
        return
    secret = ClusterSecret.generate()
    write_secret_file(source.path, secret)
    log.info("new cluster secret written to %s (mode 0600)", source.path)
    try:
        yield secret
    finally:
        if not source.given:
            source.path.unlink(missing_ok=True)


@contextlib.contextmanager
def ray_token_auth(secret: ClusterSecret, source: SecretSource) -> Iterator[None]:
    """Token authentication, with the secret's token, for the local Ray cluster started in the
    ``with`` block (and its processes, which inherit the variables). Leaves Ray's variables
    alone when the user set any of them."""
    chosen = [name for name in _RAY_AUTH_VARIABLES if name in os.environ]
    if chosen:
        log.info("Ray authentication as %s say", ", ".join(chosen))
        yield
        return
    token_file = source.ray_token_file
    write_private_text(token_file, secret.ray_token())
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    _reload_ray_config()
    try:
        yield
    finally:
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
            os.environ.pop(name, None)
        _reload_ray_config()
        token_file.unlink(missing_ok=True)


def _reload_ray_config() -> None:
    # Ray reads RAY_AUTH_MODE into its config once per process; ray.init() of a new cluster
    # would start the daemons in token mode (they read the variables) while this process, the
    # driver, still spoke without one. Ray's own switch to token mode reloads it the same way.
    from ray._raylet import Config  # type: ignore[attr-defined]  # not in its stubs

    Config.initialize("")
