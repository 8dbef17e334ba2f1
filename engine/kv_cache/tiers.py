"""What the prefix cache knows of the tiers under the pool (pure: no torch, no I/O).

A full, cached block evicted from the pool may live on below it, in host memory or on disk
(``engine/tiers/``). The manager asks whether a hash is held there, in which tier, and which
blocks moved (for the KV events); the engine moves the bytes. :class:`LruBytes` is the
replacement policy every tier shares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from pdserve.engine.kv_cache.hashing import BlockHash


class KVTier(IntEnum):
    """Where a cached block lives, fastest first. The values are the locality index's codes
    (docs/redis-schema.md), so they never change."""

    POOL = 1
    HOST = 2
    DISK = 3


class LowerTiers(Protocol):
    """The tiers below the pool, as the prefix lookup and the KV events see them."""

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether some tier can load the block with this hash back into the pool (a disk
        tier may read the block ahead here)."""
        ...

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        """A prompt with these block hashes arrived: a slow tier may start reading them."""
        ...

    def tier_of(self, block_hash: BlockHash) -> KVTier | None:
        """The fastest tier below the pool that holds the block, without reading it."""
        ...

    def block_hashes(self, tier: KVTier) -> Iterable[BlockHash]:
        """Every hash ``tier`` (``HOST`` or ``DISK``) holds."""
        ...

    def take_moved(self) -> list[BlockHash]:
        """Hashes whose place may have changed since the last call (stored in a tier, pushed
        down, dropped), oldest first; clears them."""
        ...


class LruBytes:
    """Block hashes with their sizes, least recently used first, within ``capacity_bytes``.

    ``add`` returns the hashes it pushed out to make room, oldest first; an entry larger than
    the whole capacity is refused (returned as its own eviction).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[BlockHash]:
        """Least recently used first."""
        return iter(self._sizes)

    def add(self, block_hash: BlockHash, size_bytes: int) -> list[BlockHash]:
        """Insert (or refresh) ``block_hash`` as most recent; return the hashes evicted."""
        if size_bytes > self.capacity_bytes:
            return [block_hash]
        self.remove(block_hash)
        evicted: list[BlockHash] = []
        while self.used_bytes + size_bytes > self.capacity_bytes:
            oldest, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
            evicted.append(oldest)
        self._sizes[block_hash] = size_bytes
        self.used_bytes += size_bytes
        return evicted

    def touch(self, block_hash: BlockHash) -> None:
        """Mark as most recently used."""
        self._sizes.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> bool:
        size = self._sizes.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True


@dataclass(slots=True, frozen=True)
class TierStats:
    """The tiers' counters since the engine started (zeros when no tier is configured).

    Hits are prompt tokens served from a tier (they count as prefix-hit tokens too); bytes
    are the codec's payloads moved (``engine/tiers/codec.py``): into a tier when stored, out of
    it when loaded back.
    """

    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_stored_blocks: int = 0  # evicted from the pool into host memory
    disk_stored_blocks: int = 0  # evicted from host memory onto disk
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    disk_bytes_in: int = 0
    disk_bytes_out: int = 0
    host_used_bytes: int = 0
    disk_used_bytes: int = 0
    disk_stopped: bool = False  # a write failed (e.g. the disk is full): no more disk writes
