"""The host-memory tier: records of blocks evicted from the pool (``codec.py``), bounded in
bytes, LRU."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import LruBytes


class HostTier:
    """Records (uint8 tensors) by hash within ``capacity_bytes``; ``put`` hands back what it
    spills."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = LruBytes(capacity_bytes)
        self._blocks: dict[BlockHash, torch.Tensor] = {}

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def put(
        self, block_hash: BlockHash, record: torch.Tensor
    ) -> list[tuple[BlockHash, torch.Tensor]]:
        """Keep ``record`` as most recent; return the records pushed out (oldest first),
        possibly ``record`` itself when it is larger than the whole tier."""
        self._blocks[block_hash] = record
        spilled = self._lru.add(block_hash, record.numel())
        return [(h, self._blocks.pop(h)) for h in spilled]

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The record (now most recent), or None."""
        record = self._blocks.get(block_hash)
        if record is not None:
            self._lru.touch(block_hash)
        return record

    def touch(self, block_hash: BlockHash) -> None:
        self._lru.touch(block_hash)
