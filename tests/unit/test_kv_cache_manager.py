"""Block hashes and the KVCacheManager: prefix hits, back-pressure, fork + COW, imports."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pdserve.engine.kv_cache import (
    BlockHasher,
    BlocksRemoved,
    BlocksStored,
    KVCacheManager,
    block_hashes,
    encode_extra_keys,
    hash_block,
    kv_block_bytes,
    make_extra_keys,
    num_blocks_for_budget,
)

EXTRA = make_extra_keys("smollm2")


# -- hashing ---------------------------------------------------------------------------
def _reference_hash(parent: int | None, tokens: list[int], keys: tuple[str, ...]) -> int:
    """The documented byte encoding, written out independently of hashing.py."""
    data = b"pdserve.block.v1"
    data += b"\x00" if parent is None else b"\x01" + struct.pack("<Q", parent)
    data += struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    data += struct.pack("<I", len(keys))
    for key in keys:
        raw = key.encode()
        data += struct.pack("<I", len(raw)) + raw
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def test_block_hashes_follow_the_documented_encoding_and_chain() -> None:
    tokens = [1, 2, 3, 4, 70000, 6, 7]  # one partial block at the end is ignored
    h0 = _reference_hash(None, [1, 2, 3], EXTRA)
    h1 = _reference_hash(h0, [4, 70000, 6], EXTRA)
    assert block_hashes(tokens, 3, EXTRA) == [h0, h1]
    assert hash_block(None, [1, 2, 3], encode_extra_keys(EXTRA)) == h0


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    a = block_hashes([1, 2, 3, 4], 2, EXTRA)
    b = block_hashes([9, 9, 3, 4], 2, EXTRA)
    assert a[1] != b[1]  # same block tokens, different parent
    assert block_hashes([1, 2], 2, make_extra_keys("other-model")) != a[:1]
    assert block_hashes([1, 2], 2, make_extra_keys("smollm2", cache_salt="s")) != a[:1]
    assert make_extra_keys("m", "lora1", "s") == ("model:m", "lora:lora1", "salt:s")


def test_incremental_hasher_equals_batch_and_parent_chaining() -> None:
    tokens = list(range(10))
    hasher = BlockHasher(4, EXTRA)
    assert hasher.update(tokens[:3]) == []
    assert hasher.update(tokens[:9]) == block_hashes(tokens[:8], 4, EXTRA)
    assert hasher.update(tokens) == []
    assert list(hasher.hashes) == block_hashes(tokens, 4, EXTRA)
    first = block_hashes(tokens[:4], 4, EXTRA)
    assert first + block_hashes(tokens[4:8], 4, EXTRA, parent=first[-1]) == list(hasher.hashes)


def test_hash_rejects_token_ids_outside_u32() -> None:
    with pytest.raises(ValueError, match=r"\[-1\]"):
        block_hashes([1, -1], 2)
    with pytest.raises(ValueError, match="model_id"):
        make_extra_keys("")


# -- allocation and prefix cache --------------------------------------------------------
def test_allocate_grows_table_and_caches_computed_full_blocks() -> None:
    kv = KVCacheManager(4, 2, extra_keys=EXTRA)
    tokens = [1, 2, 3, 4, 5]
    assert kv.allocate("a", tokens, 0, 3) == [0, 1]
    assert kv.drain_events() == []  # nothing computed yet
    kv.commit_computed("a", tokens, 3)  # block 0 full and computed; block 1 half
    hashes = block_hashes(tokens, 2, EXTRA)
    assert kv.drain_events() == [BlocksStored((hashes[0],))]
    assert kv.allocate("a", tokens, 3, 2) == [0, 1, 2]
    assert kv.drain_events() == []  # block 1 is full but its token 4 is not computed yet
    kv.commit_computed("a", tokens, 5)
    assert kv.drain_events() == [BlocksStored((hashes[1],))]
    assert kv.num_free_blocks == 1
    assert kv.usage == 0.75


def test_prefix_hit_revives_free_blocks_and_never_covers_the_last_token() -> None:
    kv = KVCacheManager(4, 2, extra_keys=EXTRA)
    a = [1, 2, 3, 4, 5]
    kv.allocate("a", a, 0, 5)
    kv.commit_computed("a", a, 5)
    kv.free("a")  # tail first: queue [3, 2, 1, 0]
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    full = kv.lookup_prefix([1, 2, 3, 4])
    assert (full.block_ids, full.num_tokens) == ((0,), 2)  # capped at 3 tokens -> 1 block
    b = [1, 2, 3, 4, 9, 9, 9]
    match = kv.lookup_prefix(b)
    assert (match.block_ids, match.num_tokens) == ((0, 1), 4)
    assert kv.allocate("b", b, 4, 3, prefix=match) == [0, 1, 3, 2]
    assert (kv.prefix_hit_tokens, kv.prefix_queried_tokens) == (4, 5 + 7)
    assert kv.num_free_blocks == 0


def test_back_pressure_returns_none_and_leaks_nothing() -> None:
    kv = KVCacheManager(4, 2, extra_keys=EXTRA)
    a = [1, 2, 3, 4]
    kv.allocate("a", a, 0, 4)
    kv.commit_computed("a", a, 4)
    kv.free("a")
    kv.drain_events()
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    assert kv.allocate("x", [7, 7, 7], 0, 3) == [2, 3]  # uncached blocks go first
    b = [1, 2, 3, 4, 5, 6, 7]  # hits 2 free cached blocks, needs 2 fresh: 4 > 2 free
    match = kv.lookup_prefix(b)
    assert match.num_tokens == 4
    before = kv.pool.free_block_ids()
    assert kv.allocate("b", b, 4, 3, prefix=match) is None
    assert "b" not in kv
    assert kv.pool.free_block_ids() == before
    assert [kv.pool.ref_count(i) for i in range(4)] == [0, 0, 1, 1]
    assert kv.drain_events() == []
    assert kv.prefix_queried_tokens == 4 + 3  # a and x; the refused b is not counted
    assert kv.allocate("x", [7, 7, 7, 8, 8, 8, 8], 3, 4) == [2, 3, 1, 0]
    h0, h1 = block_hashes(a, 2, EXTRA)
    assert kv.drain_events() == [
        BlocksRemoved((h1, h0)),  # a's tail block went first
        BlocksStored((block_hashes([7, 7], 2, EXTRA)[0],)),  # x's computed first block
    ]


def test_tail_blocks_are_evicted_first() -> None:
    kv = KVCacheManager(3, 2, extra_keys=EXTRA)
    a = [1, 2, 3, 4, 5, 6]
    kv.allocate("a", a, 0, 6)
    kv.commit_computed("a", a, 6)
    kv.free("a")
    kv.drain_events()
    kv.allocate("z", [0, 0], 0, 2)
    assert kv.block_table("z") == (2,)
    assert kv.drain_events() == [BlocksRemoved((block_hashes(a, 2, EXTRA)[2],))]
    assert kv.lookup_prefix(a).block_ids == (0, 1)


def test_fork_then_copy_on_write_of_the_partly_filled_block() -> None:
    kv = KVCacheManager(8, 4, extra_keys=EXTRA)
    prompt = [10, 11, 12, 13, 14, 15]
    kv.allocate("p", prompt, 0, 6)
    kv.fork("p", "c")
    assert kv.block_table("c") == (0, 1)
    assert [kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]
    # The child recomputes position 5 (in shared block 1, which also holds 4).
    assert kv.allocate("c", prompt, 5, 1) == [0, 2]
    assert kv.take_block_copies() == [(1, 2)]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    # The parent now owns block 1 alone: writing position 6 needs no copy.
    assert kv.allocate("p", [*prompt, 99], 6, 1) == [0, 1]
    assert kv.take_block_copies() == []
    kv.free("p")
    assert kv.pool.ref_count(0) == 1
    assert 0 not in kv.pool.free_block_ids()


def test_cow_without_copy_when_the_block_holds_no_needed_position() -> None:
    kv = KVCacheManager(8, 4, extra_keys=EXTRA)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate("p", prompt, 0, 5)
    kv.fork("p", "c")
    assert kv.allocate("c", prompt, 4, 1) == [0, 2]  # position 4 starts block 1
    assert kv.take_block_copies() == []


def test_import_reservation_reports_locally_present_blocks() -> None:
    kv = KVCacheManager(8, 4, extra_keys=EXTRA)
    local = list(range(10))
    kv.allocate("x", local, 0, 10)
    kv.commit_computed("x", local, 10)  # blocks 0 and 1 cached
    kv.drain_events()
    prompt = [*local[:8], 99, 98, 97, 96, 95]
    res = kv.reserve_for_import("y", prompt)
    assert res is not None
    assert (res.block_ids, res.num_local_blocks, res.num_local_tokens) == ((0, 1, 3, 4), 2, 8)
    assert res.blocks_to_receive == (3, 4)
    assert kv.drain_events() == []  # imported blocks are not cached before the KV lands
    kv.commit_import("y")
    kv.commit_import("y")  # idempotent
    assert kv.drain_events() == [BlocksStored((block_hashes(prompt, 4, EXTRA)[2],))]
    assert kv.lookup_prefix([*prompt[:12], 1]).block_ids == (0, 1, 3)


def test_import_of_a_fully_cached_prompt_needs_no_transfer() -> None:
    kv = KVCacheManager(4, 4, extra_keys=EXTRA)
    tokens = list(range(8))
    kv.allocate("x", tokens, 0, 8)
    kv.commit_computed("x", tokens, 8)
    res = kv.reserve_for_import("y", tokens)
    assert res is not None
    assert (res.block_ids, res.blocks_to_receive) == ((0, 1), ())


def test_failed_import_is_freed_and_short_pool_returns_none() -> None:
    kv = KVCacheManager(3, 4, extra_keys=EXTRA)
    assert kv.reserve_for_import("big", list(range(13))) is None
    assert kv.num_free_blocks == 3 and "big" not in kv
    res = kv.reserve_for_import("y", list(range(9)))
    assert res is not None and res.block_ids == (0, 1, 2)
    kv.free("y")  # the transfer failed
    assert kv.num_free_blocks == 3
    assert kv.drain_events() == []


def test_prefix_caching_disabled_never_hits_or_emits() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    kv.allocate("a", tokens, 0, 5)
    kv.commit_computed("a", tokens, 5)
    assert kv.lookup_prefix(tokens).num_tokens == 0
    assert kv.drain_events() == []


def test_caller_errors_raise_value_error() -> None:
    kv = KVCacheManager(4, 2)
    with pytest.raises(ValueError, match="sum <= 2 tokens"):
        kv.allocate("a", [1, 2], 1, 2)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.free("nobody")
    kv.allocate("a", [1, 2], 0, 2)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.fork("a", "a")


def test_pool_sizing_helpers() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32, block size 16.
    per_block = kv_block_bytes(30, 16, 3, 64, 4)
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert num_blocks_for_budget(10 * per_block + per_block - 1, per_block) == 10
    with pytest.raises(ValueError, match="head_dim"):
        kv_block_bytes(30, 16, 3, 0, 4)


def test_an_int8_pool_holds_about_twice_the_blocks_of_bf16_in_the_same_memory() -> None:
    """SmolLM2-135M's blocks: bf16 rows of 64 values take 128 bytes, int8 rows 64 values and
    a 2-byte scale (66 bytes), so 2 GiB hold 1.94x the blocks."""
    bf16 = kv_block_bytes(30, 16, 3, 64, 2)
    int8 = kv_block_bytes(30, 16, 3, 64, 1, row_scale_bytes=2)
    assert (bf16, int8) == (30 * 2 * 16 * 3 * 128, 30 * 2 * 16 * 3 * 66) == (368_640, 190_080)
    budget = 2 * 1024**3
    blocks_bf16, blocks_int8 = (num_blocks_for_budget(budget, b) for b in (bf16, int8))
    assert (blocks_bf16, blocks_int8) == (5825, 11297)
    assert 1.9 < blocks_int8 / blocks_bf16 < 2.0
    with pytest.raises(ValueError, match="row_scale_bytes"):
        kv_block_bytes(30, 16, 3, 64, 1, row_scale_bytes=-1)
