"""Where each cached block lives, for the locality index: the pool, host memory or disk
(pure). The pool records its own events; these functions add what the tiers under it know.

A block may sit in several places at once (host memory keeps a copy of a block loaded back
into the pool); the index is told the fastest, since that is what a prefix hit costs here.
"""

from __future__ import annotations

from pdserve.engine.kv_cache.block_pool import BlockPool
from pdserve.engine.kv_cache.events import BlocksRemoved, BlocksStored, CachedBlocks, KVCacheEvent
from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import KVTier, LowerTiers

_BELOW_POOL = (KVTier.HOST, KVTier.DISK)


def below_pool(tiers: LowerTiers, skip: set[BlockHash]) -> dict[BlockHash, KVTier]:
    """The tiers' hashes not in ``skip``, each with the fastest tier holding it."""
    found: dict[BlockHash, KVTier] = {}
    for tier in _BELOW_POOL:
        for block_hash in tiers.block_hashes(tier):
            if block_hash not in skip:
                found.setdefault(block_hash, tier)
    return found


def cached_blocks(pool: BlockPool, tiers: LowerTiers | None) -> CachedBlocks:
    """Every hash the worker can serve: the pool's, then the tiers' it lacks."""
    in_pool = pool.cached_block_hashes()
    below = below_pool(tiers, set(in_pool)) if tiers is not None else {}
    hashes = in_pool + tuple(below)
    return CachedBlocks(hashes, (KVTier.POOL,) * len(in_pool) + tuple(below.values()))


def stored_by_tier(blocks: dict[BlockHash, KVTier]) -> list[KVCacheEvent]:
    """One ``BlocksStored`` per tier, fastest tier first."""
    grouped: dict[KVTier, list[BlockHash]] = {}
    for block_hash, tier in blocks.items():
        grouped.setdefault(tier, []).append(block_hash)
    return [BlocksStored(tuple(grouped[t]), t) for t in sorted(grouped)]


def tier_move_events(pool: BlockPool, tiers: LowerTiers) -> list[KVCacheEvent]:
    """Events for the blocks the tiers moved since the last call: stored in the fastest
    tier below the pool that holds each, removed when none does. A block the pool caches is
    left alone: the pool's own events place it."""
    placed: dict[BlockHash, KVTier] = {}
    removed: list[BlockHash] = []
    for block_hash in dict.fromkeys(tiers.take_moved()):
        if pool.lookup(block_hash) is not None:
            continue
        tier = tiers.tier_of(block_hash)
        if tier is None:
            removed.append(block_hash)
        else:
            placed[block_hash] = tier
    events = stored_by_tier(placed)
    if removed:
        events.append(BlocksRemoved(tuple(removed)))
    return events
