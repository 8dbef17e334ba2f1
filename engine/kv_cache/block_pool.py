"""The fixed pool of KV blocks: reference counts, an LRU free queue and the prefix-cache map.

Every block id ``0 .. num_blocks - 1`` is usable: there is no reserved null block (the runner
pads nothing with a dummy block; a block table only ever lists real blocks).

Free queue (LRU, head = next to be reused)::

    head -> [b7] [b3] [b9] ... [b2] <- tail
            allocate() pops here    free() appends here

A free block may still hold a cached hash: it stays findable by :meth:`BlockPool.lookup` and
can be revived with :meth:`BlockPool.touch` until ``allocate`` reuses it, which evicts the hash
(a ``BlocksRemoved`` event). At most one block holds a given hash; caching a second block with
a hash already present leaves that block uncached (its KV equals the first one's).

With ``keep_evictions`` the pool instead remembers which block held each evicted hash, until
:meth:`BlockPool.take_evictions`: the engine saves those blocks' KV to the tiers below the
pool before the step overwrites them, and whoever takes an eviction reports where the block
went (:meth:`BlockPool.record`: stored in a tier, or removed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.kv_cache.events import BlocksRemoved, BlocksStored, CacheCleared, KVCacheEvent
from pdserve.engine.kv_cache.hashing import BlockHash


@dataclass(slots=True)
class Block:
    """One physical block: its id, how many block tables hold it, and its hash if cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """``num_blocks`` blocks, fixed at construction; never grows."""

    def __init__(self, num_blocks: int, keep_evictions: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVCacheEvent] = []
        self._keep_evictions = keep_evictions
        self._evictions: list[tuple[int, BlockHash]] = []

    # -- sizes -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached or not): what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one sequence."""
        return 1.0 - len(self._free) / len(self._blocks)

    # -- allocation ------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref_cnt 1.

        All or nothing: returns None (changing nothing) if fewer blocks are free. Reusing a
        block that holds a cached hash evicts that hash.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            return None
        taken: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            block_id, _none = self._free.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self._keep_evictions:
                    self._evictions.append((block_id, block.block_hash))
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block_id)
        if evicted and not self._keep_evictions:
            self._events.append(BlocksRemoved(tuple(evicted)))
        return taken

    def free(self, block_ids: Iterable[int], reuse_first: bool = False) -> None:
        """Drop one reference from each block, in the given order; a block whose count
        reaches 0 joins the tail of the free queue (so earlier ids are evicted earlier).

        ``reuse_first``: blocks that cache nothing go to the head instead (speculative
        slots rolled back): the next allocation takes them, not a cached block.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if reuse_first and block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    # -- prefix cache ----------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block caching ``block_hash`` (held or free), or None."""
        return self._cached.get(block_hash)

    def cache_blocks(self, blocks: Iterable[tuple[int, BlockHash]]) -> None:
        """Register full, computed, held blocks under their hashes (one ``BlocksStored``)."""
        stored: list[BlockHash] = []
        for block_id, block_hash in blocks:
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"caching block {block_id} that no sequence holds"
            if block.block_hash is not None:
                assert block.block_hash == block_hash, (
                    f"block {block_id} is cached as {block.block_hash:#x}, not {block_hash:#x}"
                )
                continue
            if block_hash in self._cached:
                continue  # another block already holds this content
            block.block_hash = block_hash
            self._cached[block_hash] = block_id
            stored.append(block_hash)
        if stored:
            self._events.append(BlocksStored(tuple(stored)))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their KV but are no longer shared)."""
        for block_id in self._cached.values():
            self._blocks[block_id].block_hash = None
        self._cached.clear()
        self._events.append(CacheCleared())

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash currently cached (for a snapshot to the locality index)."""
        return tuple(self._cached)

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """``(block_id, evicted hash)`` pairs since the last call, oldest first; clears them.
        The block still holds that hash's KV until the next step writes it. No event was
        recorded for them: the caller records where each went."""
        evictions, self._evictions = self._evictions, []
        return evictions

    def record(self, event: KVCacheEvent) -> None:
        """Append an event about blocks below the pool (see ``take_evictions``)."""
        self._events.append(event)

    def drain_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last drain, oldest first; clears them."""
        events, self._events = self._events, []
        return events

    # -- inspection ------------------------------------------------------------------
    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """Free blocks in reuse order (head first)."""
        return list(self._free)
