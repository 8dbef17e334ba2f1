"""One sequence's block table: growth bookkeeping, copy-on-write and prefix-cache commits.

Block table of one sequence (block_size 4, 10 tokens, 8 of them computed)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table       [  12   |    5    |   30   ]      position p -> table[p // 4], offset p % 4
    state       full,   | full,   | partial
                cached  | cached  | (never cached)

A block is offered to the prefix cache once it is full *and* all its tokens are computed.
A sequence about to write into a block that another table also holds (after a fork) gets a
fresh block instead; if the old block holds positions it still reads, a ``(src, dst)`` copy
is produced for the runner.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.kv_cache.block_pool import BlockPool
from pdserve.engine.kv_cache.hashing import BlockHasher


class SequenceBlocks:
    """The blocks one sequence holds, in position order, and its hashing progress."""

    __slots__ = ("_block_size", "_pool", "block_ids", "hasher", "import_token_ids", "num_cached")

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        block_ids: list[int],
        hasher: BlockHasher | None,
        num_cached: int,
    ) -> None:
        self._pool = pool
        self._block_size = block_size
        self.block_ids = block_ids
        self.hasher = hasher  # None when prefix caching is off
        self.num_cached = num_cached  # leading blocks already offered to the prefix cache
        self.import_token_ids: tuple[int, ...] | None = None  # set until commit_import

    def shared_write_indices(self, start: int, end: int) -> list[int]:
        """Indices of held blocks that positions ``start .. end - 1`` write into and that
        another block table also holds."""
        if end <= start:
            return []
        first, last = start // self._block_size, (end - 1) // self._block_size
        stop = min(last + 1, len(self.block_ids))
        return [j for j in range(first, stop) if self._pool.ref_count(self.block_ids[j]) > 1]

    def copy_on_write(
        self, indices: list[int], fresh: list[int], num_computed: int
    ) -> list[tuple[int, int]]:
        """Swap each shared block for a fresh one; return the ``(src, dst)`` copies needed."""
        copies: list[tuple[int, int]] = []
        for index, new_block in zip(indices, fresh, strict=True):
            old_block = self.block_ids[index]
            # Copy only if the block holds computed positions this sequence keeps reading.
            if index * self._block_size < num_computed:
                copies.append((old_block, new_block))
            self.block_ids[index] = new_block
            self._pool.free([old_block])
        return copies

    def commit(self, token_ids: Sequence[int], num_computed: int) -> None:
        """Offer every full, computed, not yet offered block to the prefix cache."""
        num_full = num_computed // self._block_size
        if self.hasher is None or num_full <= self.num_cached:
            return
        self.hasher.update(token_ids)
        assert self.hasher.num_hashed_blocks >= num_full, (
            f"{self.hasher.num_hashed_blocks} blocks hashed but {num_full} computed"
        )
        self._pool.cache_blocks(
            (self.block_ids[j], self.hasher.hash_at(j)) for j in range(self.num_cached, num_full)
        )
        self.num_cached = num_full
