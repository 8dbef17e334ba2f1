"""The tiers under the pool, pure side: LRU by bytes, lookups through the tiers, loads and
evictions with exact block ids, reference counts and KV events (no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.engine.kv_cache import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CachedBlocks,
    KVCacheManager,
    KVTier,
    block_hashes,
)
from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import LruBytes
from tests.import_probe import run_probe

BS = 4


class SetTiers:
    """Tiers that hold exactly the hashes in ``held`` (in host memory unless said), and
    report as moved whatever a test puts in ``moved``."""

    def __init__(self, held: set[BlockHash], tier: KVTier = KVTier.HOST) -> None:
        self.held = dict.fromkeys(held, tier)
        self.moved: list[BlockHash] = []
        self.prefetched: list[BlockHash] = []

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self.held

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        self.prefetched += block_hashes

    def tier_of(self, block_hash: BlockHash) -> KVTier | None:
        return self.held.get(block_hash)

    def block_hashes(self, tier: KVTier) -> Iterable[BlockHash]:
        return [h for h, t in self.held.items() if t is tier]

    def take_moved(self) -> list[BlockHash]:
        moved, self.moved = self.moved, []
        return moved


def _hashes(tokens: list[int]) -> list[BlockHash]:
    return block_hashes(tokens, BS, ())


def test_lru_bytes_evicts_oldest_first_within_its_capacity() -> None:
    lru = LruBytes(100)
    assert lru.add(1, 40) == [] and lru.add(2, 40) == []
    lru.touch(1)  # 2 is now the oldest
    assert lru.add(3, 40) == [2]
    assert list(lru) == [1, 3] and lru.used_bytes == 80
    assert lru.add(4, 70) == [1, 3]
    assert lru.add(5, 101) == [5], "an entry larger than the tier is refused"
    assert list(lru) == [4] and lru.used_bytes == 70
    assert lru.add(4, 30) == [] and lru.used_bytes == 30, "re-adding replaces the size"


def test_evicted_cached_blocks_are_reported_with_their_block_ids() -> None:
    kv = KVCacheManager(4, BS, tiers=SetTiers(set()))
    tokens = list(range(9))  # two full blocks + one token
    assert kv.allocate("a", tokens, 0, 9) == [0, 1, 2]
    kv.commit_computed("a", tokens, 9)
    kv.free("a")  # free queue: 3, 2, 1, 0 (tail first)
    kv.drain_events()
    assert kv.allocate("b", [7] * 12, 0, 12) == [3, 2, 1]
    h = _hashes(tokens)
    assert kv.take_evictions() == [(1, h[1])]
    assert kv.drain_events() == [], "whoever saves the evicted block says where it went"
    assert kv.take_evictions() == []


def test_lookup_continues_into_the_tiers_and_allocate_queues_the_loads() -> None:
    tokens = list(range(17))  # four full blocks + one token
    h = _hashes(tokens)
    tiers = SetTiers({h[1], h[2]})
    kv = KVCacheManager(8, BS, tiers=tiers)
    kv.allocate("old", tokens[:4], 0, 4)
    kv.commit_computed("old", tokens[:4], 4)
    kv.free("old")  # block 0 caches h[0]; free queue: 1..7, 0
    kv.drain_events()

    match = kv.lookup_prefix(tokens)
    assert match.block_ids == (0,) and match.num_tier_blocks == 2 and match.num_tokens == 12
    table = kv.allocate("s", tokens, 12, 5, match)
    assert table == [0, 1, 2, 3, 4]
    assert kv.take_block_loads() == [(1, h[1]), (2, h[2])]
    assert [kv.pool.ref_count(b) for b in table] == [1, 1, 1, 1, 1]
    assert [kv.pool.block_hash(b) for b in table[:3]] == h[:3]
    assert kv.drain_events() == [BlocksStored((h[1], h[2]))], "a loaded block is stored again"
    assert kv.prefix_hit_tokens == 12 and kv.prefix_queried_tokens == 4 + 17
    assert kv.take_block_loads() == []


def test_the_tier_run_stops_at_the_first_hash_no_tier_holds_and_spares_the_last_token() -> None:
    tokens = list(range(12))  # exactly three blocks: the last one is never a hit
    h = _hashes(tokens)
    kv = KVCacheManager(8, BS, tiers=SetTiers({h[0], h[2]}))
    assert kv.lookup_prefix(tokens).num_tier_blocks == 1
    kv = KVCacheManager(8, BS, tiers=SetTiers({h[0], h[1], h[2]}))
    match = kv.lookup_prefix(tokens)
    assert match.num_tier_blocks == 2 and match.num_tokens == 8


def test_an_arriving_prompt_asks_the_tiers_for_its_blocks_past_the_pool() -> None:
    tokens = list(range(17))  # four full blocks + one token
    h = _hashes(tokens)
    tiers = SetTiers({h[1], h[2]})
    kv = KVCacheManager(8, BS, tiers=tiers)
    kv.allocate("old", tokens[:4], 0, 4)
    kv.commit_computed("old", tokens[:4], 4)
    kv.free("old")  # the pool caches h[0]
    kv.prefetch(tokens)
    assert tiers.prefetched == h[1:4]  # past the pool's, never the last token's block
    assert kv.take_block_loads() == [] and kv.num_free_blocks == 8, "changes nothing"


def test_no_tiers_without_prefix_caching() -> None:
    tokens = list(range(9))
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, tiers=SetTiers(set(_hashes(tokens))))
    assert kv.lookup_prefix(tokens).num_tokens == 0


def test_moved_blocks_are_stored_in_their_fastest_tier_or_removed() -> None:
    tokens = list(range(13))  # three full blocks + one token
    h = _hashes(tokens)
    tiers = SetTiers({h[1]})
    tiers.held[h[2]] = KVTier.DISK
    kv = KVCacheManager(8, BS, tiers=tiers)
    kv.allocate("a", tokens[:4], 0, 4)
    kv.commit_computed("a", tokens[:4], 4)  # the pool caches h[0]
    kv.drain_events()
    tiers.moved = [h[0], h[1], h[2], 99, h[1]]  # 99: dropped by every tier
    kv.publish_tier_moves()
    assert kv.drain_events() == [
        BlocksStored((h[1],), KVTier.HOST),
        BlocksStored((h[2],), KVTier.DISK),
        BlocksRemoved((99,)),
    ], "the pool's own block is left to the pool's events"
    kv.publish_tier_moves()
    assert kv.drain_events() == []


def test_a_snapshot_names_each_block_once_in_its_fastest_tier() -> None:
    tokens = list(range(9))
    h = _hashes(tokens)
    tiers = SetTiers({h[0], h[1]})
    tiers.held[7] = KVTier.DISK
    kv = KVCacheManager(8, BS, tiers=tiers)
    kv.allocate("a", tokens, 0, 9)
    kv.commit_computed("a", tokens, 9)  # h[0], h[1] in the pool too
    assert kv.cached_blocks() == CachedBlocks(
        (h[0], h[1], 7), (KVTier.POOL, KVTier.POOL, KVTier.DISK)
    )
    kv.reset_prefix_cache()
    assert kv.drain_events()[-3:] == [
        CacheCleared(),
        BlocksStored((h[0], h[1]), KVTier.HOST),
        BlocksStored((7,), KVTier.DISK),
    ], "the tiers still hold their blocks after the pool forgot its own"


def test_an_import_reservation_counts_the_tier_hits_as_present_and_loads_them() -> None:
    tokens = list(range(14))  # three full blocks + two tokens
    h = _hashes(tokens)
    kv = KVCacheManager(8, BS, tiers=SetTiers({h[0], h[1]}))
    reservation = kv.reserve_for_import("imp", tokens)
    assert reservation is not None
    assert (reservation.num_local_blocks, reservation.num_local_tokens) == (2, 8)
    assert reservation.block_ids == (0, 1, 2, 3)
    assert kv.take_block_loads() == [(0, h[0]), (1, h[1])]
    assert kv.drain_events() == [BlocksStored((h[0], h[1]))], "cached as they load"
    assert reservation.blocks_to_receive == (2, 3)


def test_tier_policy_runs_without_heavy_packages() -> None:
    run_probe(
        """
from pdserve.engine.kv_cache.tiers import LruBytes, LowerTiers, TierStats
assert LruBytes(1).add(1, 2) == [1]
""",
        ("torch", "numpy"),
    )
