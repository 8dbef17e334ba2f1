"""BlockPool on tiny pools: exact block ids, LRU eviction order, prefix hits, events."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache import BlockPool, BlocksRemoved, BlocksStored, CacheCleared


def test_allocates_lowest_ids_first_then_reuses_freed_blocks_lru() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])  # 1 joins the free queue before 0
    assert pool.free_block_ids() == [3, 1, 0]
    assert pool.allocate(2) == [3, 1]
    assert pool.allocate(1) == [0]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None
    assert pool.free_block_ids() == [2]
    assert pool.ref_count(2) == 0
    assert pool.allocate(0) == []


def test_shared_block_returns_to_queue_only_at_last_reference() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1) or []
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.free_block_ids() == [1]
    pool.free([block])
    assert pool.free_block_ids() == [1, 0]


def test_free_cached_block_stays_findable_and_touch_revives_it() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    pool.cache_blocks([(0, 111), (1, 222)])
    pool.free([1, 0])
    assert pool.lookup(111) == 0
    assert pool.free_block_ids() == [2, 1, 0]
    pool.touch([0])  # a prefix hit on a free cached block takes it out of the queue
    assert pool.ref_count(0) == 1
    assert pool.free_block_ids() == [2, 1]
    assert pool.lookup(111) == 0
    # The next allocation takes the uncached block 2, then evicts block 1 (hash 222).
    assert pool.allocate(1) == [2]
    assert pool.lookup(222) == 1
    assert pool.allocate(1) == [1]
    assert pool.lookup(222) is None
    assert pool.block_hash(1) is None


def test_eviction_follows_free_order() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    pool.cache_blocks([(0, 10), (1, 11), (2, 12)])
    pool.drain_events()
    pool.free([2, 1, 0])  # a sequence frees its tail first
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [1]
    assert pool.drain_events() == [BlocksRemoved((12,)), BlocksRemoved((11,))]
    assert pool.lookup(10) == 0


def test_events_stored_removed_cleared_and_drain_clears() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.cache_blocks([(0, 5), (1, 6)])
    pool.free([0, 1])
    assert pool.allocate(2) == [0, 1]  # evicts both, in one event
    pool.cache_blocks([(0, 7)])
    pool.reset_prefix_cache()
    assert pool.drain_events() == [
        BlocksStored((5, 6)),
        BlocksRemoved((5, 6)),
        BlocksStored((7,)),
        CacheCleared(),
    ]
    assert pool.drain_events() == []
    assert pool.lookup(7) is None
    assert pool.block_hash(0) is None


def test_a_hash_is_cached_in_one_block_only() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.cache_blocks([(0, 42)])
    pool.cache_blocks([(1, 42)])  # same content computed twice: keep the first
    assert pool.lookup(42) == 0
    assert pool.block_hash(1) is None
    assert pool.drain_events() == [BlocksStored((42,))]
    assert pool.cached_block_hashes() == (42,)


def test_double_free_is_an_invariant_violation() -> None:
    pool = BlockPool(1)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([0])


def test_bad_sizes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        BlockPool(1).allocate(-1)
