"""Paged KV-cache bookkeeping: block pool, block tables, prefix hashes (pure; no torch)."""

from pdserve.engine.kv_cache.block_pool import Block, BlockPool
from pdserve.engine.kv_cache.events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CachedBlocks,
    KVCacheEvent,
)
from pdserve.engine.kv_cache.hashing import (
    BlockHash,
    BlockHasher,
    block_hashes,
    encode_extra_keys,
    hash_block,
    make_extra_keys,
)
from pdserve.engine.kv_cache.manager import ImportReservation, KVCacheManager, PrefixMatch
from pdserve.engine.kv_cache.sizing import kv_block_bytes, num_blocks_for_budget
from pdserve.engine.kv_cache.tiers import KVTier

__all__ = [
    "Block",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlocksRemoved",
    "BlocksStored",
    "CacheCleared",
    "CachedBlocks",
    "ImportReservation",
    "KVCacheEvent",
    "KVCacheManager",
    "KVTier",
    "PrefixMatch",
    "block_hashes",
    "encode_extra_keys",
    "hash_block",
    "kv_block_bytes",
    "make_extra_keys",
    "num_blocks_for_budget",
]
