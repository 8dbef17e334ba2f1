"""The host-memory tier: int8 blocks evicted from the pool, bounded in bytes, LRU."""

from __future__ import annotations

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import LruBytes
from pdserve.kv_codec import Int8Blocks


def int8_bytes(q: Int8Blocks) -> int:
    return sum(t.numel() * t.element_size() for t in (q.values, q.k_scales, q.v_scales))


class HostTier:
    """Quantized blocks by hash within ``capacity_bytes``; ``put`` hands back what it spills."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = LruBytes(capacity_bytes)
        self._blocks: dict[BlockHash, Int8Blocks] = {}

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, q: Int8Blocks) -> list[tuple[BlockHash, Int8Blocks]]:
        """Keep ``q`` as most recent; return the blocks pushed out (oldest first), possibly
        ``q`` itself when it is larger than the whole tier."""
        self._blocks[block_hash] = q
        spilled = self._lru.add(block_hash, int8_bytes(q))
        return [(h, self._blocks.pop(h)) for h in spilled]

    def get(self, block_hash: BlockHash) -> Int8Blocks | None:
        """The block (now most recent), or None."""
        q = self._blocks.get(block_hash)
        if q is not None:
            self._lru.touch(block_hash)
        return q

    def touch(self, block_hash: BlockHash) -> None:
        self._lru.touch(block_hash)
