"""KV-cache events the block pool records for the cluster's locality index.

The pool only says *what* changed. The worker drains them each step and hands them to its
publisher, which stamps the worker id, incarnation epoch and sequence number (see
``cluster/kv_events.py``); this module knows nothing of Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import KVTier


@dataclass(slots=True, frozen=True)
class BlocksStored:
    """Full blocks with these hashes are now cached on this worker, in ``tier`` (in block
    order). A block already cached elsewhere on the worker has moved: pool -> host memory
    -> disk as it is evicted, back to the pool when a prefix hit loads it."""

    block_hashes: tuple[BlockHash, ...]
    tier: KVTier = KVTier.POOL


@dataclass(slots=True, frozen=True)
class BlocksRemoved:
    """Blocks with these hashes are cached nowhere on this worker any more (evicted from the
    pool without a tier to keep them, or dropped by the last tier holding them)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class CacheCleared:
    """Every cached hash was dropped (prefix-cache reset)."""


KVCacheEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(slots=True, frozen=True)
class CachedBlocks:
    """Every block this worker can serve from its cache, each with the fastest tier holding
    it (``tiers[i]`` for ``block_hashes[i]``): what a snapshot to the locality index says."""

    block_hashes: tuple[BlockHash, ...] = ()
    tiers: tuple[KVTier, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.tiers), (
            f"{len(self.block_hashes)} block hashes but {len(self.tiers)} tiers"
        )
