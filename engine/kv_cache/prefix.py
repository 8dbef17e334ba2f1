"""Prefix hits: the leading blocks of a prompt that this worker's cache already holds, found
for its own prefill (:class:`PrefixMatch`) or for KV another worker sends
(:class:`ImportReservation`, whose leading local blocks the sender skips).

A match is only good until the pool next changes (a cached free block may be evicted), so
the manager looks up right before it allocates and checks the match is still current.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.kv_cache.block_pool import BlockPool
from pdserve.engine.kv_cache.hashing import BlockHash, BlockHasher
from pdserve.engine.kv_cache.tiers import LowerTiers


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """A prefix-cache hit: the leading cached blocks and how many tokens they cover.

    ``block_ids`` are the pool's blocks; the ``num_tier_blocks`` blocks after them are held by
    a tier below the pool and are loaded into fresh blocks on allocation. ``num_tokens``
    covers both. ``block_hashes`` are the hashes of *all* full blocks of the looked-up
    tokens, so the following ``allocate`` does not hash them again.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    block_hashes: tuple[BlockHash, ...] = ()
    num_tier_blocks: int = 0

    @property
    def tier_block_hashes(self) -> tuple[BlockHash, ...]:
        first = len(self.block_ids)
        return self.block_hashes[first : first + self.num_tier_blocks]


@dataclass(slots=True, frozen=True)
class ImportReservation:
    """Blocks reserved on the receiving worker for a sequence's prompt KV.

    ``block_ids[i]`` receives the sender's block ``i``. The first ``num_local_blocks`` are
    already here (prefix cache), so the sender skips them: it sends ``blocks_to_receive``.
    """

    seq_id: str
    block_ids: tuple[int, ...]
    num_local_blocks: int
    num_local_tokens: int

    @property
    def blocks_to_receive(self) -> tuple[int, ...]:
        return self.block_ids[self.num_local_blocks :]


def match_prefix(
    pool: BlockPool,
    block_size: int,
    encoded_extra_keys: bytes,
    token_ids: Sequence[int],
    max_tokens: int,
    tiers: LowerTiers | None = None,
) -> PrefixMatch:
    """The longest run of cached full blocks within the first ``max_tokens`` tokens: the
    pool's first, then (given ``tiers``) those the tiers below hold."""
    hashes = BlockHasher(block_size, encoded_extra_keys=encoded_extra_keys).update(token_ids)
    candidates = hashes[: max_tokens // block_size]
    hit: list[int] = []
    for block_hash in candidates:
        block_id = pool.lookup(block_hash)
        if block_id is None:
            break
        hit.append(block_id)
    num_tier = 0
    if tiers is not None:
        for block_hash in candidates[len(hit) :]:
            if not tiers.holds(block_hash):
                break
            num_tier += 1
    num_tokens = (len(hit) + num_tier) * block_size
    return PrefixMatch(tuple(hit), num_tokens, tuple(hashes), num_tier)


def assert_match_current(pool: BlockPool, seq_id: str, prefix: PrefixMatch) -> None:
    """Every matched block still caches the hash it was matched by (else: a caller bug)."""
    for block_id, block_hash in zip(prefix.block_ids, prefix.block_hashes, strict=False):
        assert pool.block_hash(block_id) == block_hash, (
            f"stale prefix match for {seq_id!r}: block {block_id} no longer caches "
            f"{block_hash:#x}; look up right before allocating"
        )
