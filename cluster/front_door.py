"""The router's front door as `pdserve up` and `pdserve router` expose it: API keys and TLS.

Both come from files (flags, or ``PDSERVE_API_KEYS_FILE`` / ``PDSERVE_TLS_CERT`` /
``PDSERVE_TLS_KEY``), never from values on the command line. One key file line is one key
(blank lines and ``#`` comments skipped). With keys, HTTP ``/v1/*`` needs
``Authorization: Bearer KEY`` (else 401) and gRPC ``pdserve.v1.Inference`` needs metadata
``authorization: Bearer KEY`` (else UNAUTHENTICATED); health, ``/metrics`` and
``/dashboard`` stay open for probes and scrapers. With a certificate, both ports serve TLS
only.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdserve.cluster.settings import Settings


def add_front_door_arguments(parser: argparse.ArgumentParser, settings: Settings) -> None:
    add = parser.add_argument
    add("--api-keys-file", type=Path, default=settings.api_keys_file, metavar="PATH",
        help="clients must send one of the keys in this file, one per line (default: "
        "PDSERVE_API_KEYS_FILE; none: no keys)")  # fmt: skip
    add("--tls-cert", type=Path, default=settings.tls_cert, metavar="PATH",
        help="serve HTTP and gRPC over TLS with this certificate chain (PEM; default: "
        "PDSERVE_TLS_CERT)")  # fmt: skip
    add("--tls-key", type=Path, default=settings.tls_key, metavar="PATH",
        help="the certificate's private key (PEM; default: PDSERVE_TLS_KEY)")  # fmt: skip


def front_door_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RouterConfig`` fields the flags give (ValueError on an unusable file)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("TLS needs both --tls-cert and --tls-key (or PDSERVE_TLS_CERT and "
                         "PDSERVE_TLS_KEY), or neither")  # fmt: skip
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
    keys = read_api_keys(args.api_keys_file) if args.api_keys_file is not None else ()
    return {
        "api_keys": keys,
        "tls_cert_path": None if args.tls_cert is None else str(args.tls_cert),
        "tls_key_path": None if args.tls_key is None else str(args.tls_key),
    }


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys in ``path``; ValueError when it cannot be read or holds none."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"API keys file {path}: {err.strerror}") from err
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"API keys file {path} holds no key (one per line; # comments)")
    return keys
