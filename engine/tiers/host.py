"""The host-memory tier: encoded blocks evicted from the pool, bounded in bytes, LRU."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import LruBytes


class HostTier:
    """Payloads (flat ``uint8``, see ``codec.py``) by hash within ``capacity_bytes``; ``put``
    hands back what it spills."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = LruBytes(capacity_bytes)
        self._blocks: dict[BlockHash, torch.Tensor] = {}

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[BlockHash]:
        """Least recently used first."""
        return iter(self._lru)

    def put(
        self, block_hash: BlockHash, payload: torch.Tensor
    ) -> list[tuple[BlockHash, torch.Tensor]]:
        """Keep ``payload`` as most recent; return the payloads pushed out (oldest first),
        possibly this one when it is larger than the whole tier."""
        self._blocks[block_hash] = payload
        spilled = self._lru.add(block_hash, payload.numel())
        return [(h, self._blocks.pop(h)) for h in spilled]

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The payload (now most recent), or None."""
        payload = self._blocks.get(block_hash)
        if payload is not None:
            self._lru.touch(block_hash)
        return payload

    def touch(self, block_hash: BlockHash) -> None:
        self._lru.touch(block_hash)
