"""In-process locality index and the router's prompt hasher."""

from __future__ import annotations

from pdserve.engine.kv_cache.hashing import block_hashes, make_extra_keys
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.router.policies import PrefixHit
from pdserve.router.state.locality import InProcessLocalityIndex, engine_prompt_hasher


def test_longest_prefix_stops_at_the_first_missing_block() -> None:
    index = InProcessLocalityIndex()
    index.stored("w0", [10, 11, 13])  # holds blocks 0, 1 and 3 but not 2
    index.stored("w1", [10])
    answer = index.longest_prefix([10, 11, 12, 13], ["w0", "w1", "w2"])
    assert answer == {"w0": PrefixHit(2), "w1": PrefixHit(1), "w2": PrefixHit(0)}


def test_removed_and_cleared_events_shrink_the_prefix() -> None:
    index = InProcessLocalityIndex()
    index.stored("w0", [1, 2, 3])
    index.removed("w0", [2])
    assert index.longest_prefix([1, 2, 3], ["w0"]) == {"w0": PrefixHit(1)}
    index.cleared("w0")
    assert index.longest_prefix([1, 2, 3], ["w0"]) == {"w0": PrefixHit(0)}


def test_a_block_stored_again_in_another_tier_moves_there() -> None:
    index = InProcessLocalityIndex()
    index.stored("w0", [1, 2, 3, 4])
    index.stored("w0", [2], KVTier.HOST)
    index.stored("w0", [3, 9], KVTier.DISK)
    assert index.longest_prefix([1, 2, 3, 4, 5], ["w0"]) == {"w0": PrefixHit(4, 1, 1)}
    index.stored("w0", [3])  # loaded back into the pool
    assert index.longest_prefix([1, 2, 3], ["w0"]) == {"w0": PrefixHit(3, 1, 0)}


def test_prompt_hasher_matches_the_engine_contract() -> None:
    hasher = engine_prompt_hasher("SmolLM2-135M", block_size=4)
    tokens = list(range(11))  # two full blocks, a partial one is not hashed
    expected = block_hashes(tokens, 4, make_extra_keys("SmolLM2-135M"))
    assert list(hasher(tokens)) == expected
    assert len(expected) == 2
    assert list(engine_prompt_hasher("other-model", block_size=4)(tokens)) != expected
