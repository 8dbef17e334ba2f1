"""KV-cache events the block pool records for the cluster's locality index.

The pool only says *what* changed. The worker drains them each step and hands them to its
publisher, which stamps the worker id, incarnation epoch and sequence number (see
``cluster/kv_events.py``); this module knows nothing of Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_cache.hashing import BlockHash


@dataclass(slots=True, frozen=True)
class BlocksStored:
    """Full blocks with these hashes are now cached on this worker (in block order)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class BlocksRemoved:
    """Cached blocks with these hashes were evicted (their blocks reused)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class CacheCleared:
    """Every cached hash was dropped (prefix-cache reset)."""


KVCacheEvent = BlocksStored | BlocksRemoved | CacheCleared
