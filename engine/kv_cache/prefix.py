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


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """A prefix-cache hit: the leading cached blocks and how many tokens they cover.

    ``block_hashes`` are the hashes of *all* full blocks of the looked-up tokens, so the
    following ``allocate`` does not hash them again.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    block_hashes: tuple[BlockHash, ...] = ()


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
) -> PrefixMatch:
    """The longest run of cached full blocks within the first ``max_tokens`` tokens."""
    hashes = BlockHasher(block_size, encoded_extra_keys=encoded_extra_keys).update(token_ids)
    hit: list[int] = []
    for block_hash in hashes[: max_tokens // block_size]:
        block_id = pool.lookup(block_hash)
        if block_id is None:
            break
        hit.append(block_id)
    return PrefixMatch(tuple(hit), len(hit) * block_size, tuple(hashes))


def assert_match_current(pool: BlockPool, seq_id: str, prefix: PrefixMatch) -> None:
    """Every matched block still caches the hash it was matched by (else: a caller bug)."""
    for block_id, block_hash in zip(prefix.block_ids, prefix.block_hashes, strict=False):
        assert pool.block_hash(block_id) == block_hash, (
            f"stale prefix match for {seq_id!r}: block {block_id} no longer caches "
            f"{block_hash:#x}; look up right before allocating"
        )
