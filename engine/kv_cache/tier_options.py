"""The KV pool and tier flags, shared by every command that runs an engine.

``add_kv_cache_dtype_argument(parser)`` adds ``--kv-cache-dtype``
(``CacheConfig.kv_cache_dtype``). ``add_kv_tier_arguments(parser)`` adds
``--kv-host-tier-bytes``, ``--kv-disk-tier-path``, ``--kv-disk-tier-bytes`` and
``--kv-tier-codec``; ``kv_tier_settings(args)`` gives the ``CacheConfig`` fields they set;
``kv_tier_flags(settings)`` turns those back into flags, for a command that starts workers.
Defaults and range checks stay in ``CacheConfig``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.engine.config import KV_CACHE_DTYPES, TIER_CODECS, CacheConfig

_DEFAULTS = CacheConfig()
_UNITS = {"": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def parse_size_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GiB"`` or plain bytes (``"4096"``) as a byte count."""
    match = _SIZE.fullmatch(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes (4096) or a number with KiB, MiB, GiB or TiB "
            "(512MiB, 2GiB)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: what the KV pool holds."""
    parser.add_argument(
        "--kv-cache-dtype", default=_DEFAULTS.kv_cache_dtype, choices=KV_CACHE_DTYPES,
        help="what the KV pool holds: auto (the model's dtype) or int8 (int8 values with a "
        "scale per token and kv head: about twice the tokens in the same memory as bf16; "
        "default: %(default)s)",
    )  # fmt: skip


def add_kv_tier_arguments(parser: argparse.ArgumentParser, per_worker_dirs: bool = False) -> None:
    """The tier flags, in a group of their own; all off by default. ``per_worker_dirs``: the
    command starts several workers, each on its own subdirectory (``kv_tier_flags``)."""
    shared = "; each worker uses its own subdirectory, DIR/WORKER_ID" if per_worker_dirs else ""
    group = parser.add_argument_group(
        "KV tiers",
        # line breaks for raw-description parsers; other parsers wrap it themselves
        "Keep cached prefix blocks the KV pool evicts in host memory and then on disk; a\n"
        "later prompt with that prefix loads them back instead of recomputing it.\n"
        "Needs prefix caching. Sizes: bytes, or a number with KiB, MiB, GiB or TiB.",
    )
    group.add_argument(
        "--kv-host-tier-bytes", type=parse_size_bytes, default=None, metavar="SIZE",
        help="host memory for evicted blocks, LRU (default: 0, off)",
    )  # fmt: skip
    group.add_argument(
        "--kv-disk-tier-path", default=None, metavar="DIR",
        help="directory for the blocks host memory pushes out, one file per block; a new "
        f"worker on the same directory serves hits from the files it finds{shared} "
        "(default: off)",
    )  # fmt: skip
    group.add_argument(
        "--kv-disk-tier-bytes", type=parse_size_bytes, default=None, metavar="SIZE",
        help="bound of --kv-disk-tier-path's files, LRU (default: "
        f"{_DEFAULTS.disk_tier_bytes // 1024**3}GiB)",
    )  # fmt: skip
    group.add_argument(
        "--kv-tier-codec", choices=TIER_CODECS, default=None,
        help="how the tiers keep a block: exact (its bytes: never changes a token) or int8 "
        "(about half a bf16 block, a quarter of fp32; not bit-exact) "
        f"(default: {_DEFAULTS.tier_codec})",
    )  # fmt: skip


def kv_tier_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``CacheConfig`` fields the flags set (flags left out are not in it); ValueError
    when a disk bound comes without a disk directory."""
    if args.kv_disk_tier_bytes is not None and args.kv_disk_tier_path is None:
        raise ValueError("--kv-disk-tier-bytes bounds the disk tier: give --kv-disk-tier-path")
    given = {
        "host_tier_bytes": args.kv_host_tier_bytes,
        "disk_tier_path": args.kv_disk_tier_path,
        "disk_tier_bytes": args.kv_disk_tier_bytes,
        "tier_codec": args.kv_tier_codec,
    }
    return {name: value for name, value in given.items() if value is not None}


def kv_tier_flags(settings: Mapping[str, Any], worker_id: str | None = None) -> list[str]:
    """Flags that make ``kv_tier_settings`` give ``settings`` again. With ``worker_id``, the
    disk directory becomes its subdirectory ``DIR/worker_id``: two disk tiers on one
    directory would index, evict and delete each other's files."""
    flags: list[str] = []
    if "host_tier_bytes" in settings:
        flags += ["--kv-host-tier-bytes", str(settings["host_tier_bytes"])]
    if "disk_tier_path" in settings:
        path = str(settings["disk_tier_path"])
        flags += ["--kv-disk-tier-path", str(Path(path) / worker_id) if worker_id else path]
    if "disk_tier_bytes" in settings:
        flags += ["--kv-disk-tier-bytes", str(settings["disk_tier_bytes"])]
    if "tier_codec" in settings:
        flags += ["--kv-tier-codec", str(settings["tier_codec"])]
    return flags
