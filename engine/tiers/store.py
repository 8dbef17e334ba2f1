"""The tiers under the KV pool, composed: host memory, then disk.

The engine calls :meth:`TierStore.sync` once the scheduler has planned a step and before the
runner writes the pool: blocks the pool evicted are read (encoded by the codec) first, then
tier hits are loaded into their fresh blocks (which may be the evicted ones), then the
evicted blocks are kept in host memory, whose overflow goes to disk. Loads are synchronous.

A disk hit is read and checked when the lookup asks for it (:meth:`TierStore.holds`) and
staged until the step's loads, so a load never meets a file that failed its checksum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import TierStats
from pdserve.engine.tiers.codec import TierCodec
from pdserve.engine.tiers.disk import DiskTier
from pdserve.engine.tiers.host import HostTier


@dataclass(slots=True)
class _Staged:
    """A disk hit read ahead of its load."""

    payload: torch.Tensor
    bytes_read: int


@dataclass(slots=True)
class _Counters:
    stats: TierStats = field(default_factory=TierStats)

    def add(self, **deltas: int) -> None:
        current = self.stats
        self.stats = dataclasses.replace(
            current, **{k: getattr(current, k) + v for k, v in deltas.items()}
        )


class TierStore:
    """Host and (optionally) disk tiers of one pool; satisfies ``LowerTiers``."""

    def __init__(self, host: HostTier, disk: DiskTier | None, codec: TierCodec) -> None:
        self._host = host
        self._disk = disk
        self._codec = codec
        self._staged: dict[BlockHash, _Staged] = {}
        self._counters = _Counters()

    def holds(self, block_hash: BlockHash) -> bool:
        if block_hash in self._host or block_hash in self._staged:
            return True
        if self._disk is None or block_hash not in self._disk:
            return False
        found = self._disk.get(block_hash)
        if found is None:
            return False
        self._staged[block_hash] = _Staged(*found)
        return True

    def sync(
        self,
        pool: torch.Tensor,
        evictions: list[tuple[int, BlockHash]],
        loads: list[tuple[int, BlockHash]],
    ) -> None:
        """Save what the pool evicted, then load the tier hits (see the module doc).

        ``pool``: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim].
        """
        saved = self._capture(pool, evictions)
        for block_id, block_hash in loads:
            self._codec.decode_into(self._take(block_hash), pool[block_id])
        self._staged.clear()
        for block_hash, q in saved:
            self._keep(block_hash, q)

    def stats(self) -> TierStats:
        host_used = self._host.used_bytes
        disk_used = self._disk.used_bytes if self._disk is not None else 0
        stopped = self._disk is not None and self._disk.stopped
        return dataclasses.replace(
            self._counters.stats,
            host_used_bytes=host_used,
            disk_used_bytes=disk_used,
            disk_stopped=stopped,
        )

    # -- internals ---------------------------------------------------------------------
    def _capture(
        self, pool: torch.Tensor, evictions: list[tuple[int, BlockHash]]
    ) -> list[tuple[BlockHash, torch.Tensor]]:
        """Encode the evicted blocks not already in host memory (those just get fresher)."""
        saved = []
        for block_id, block_hash in evictions:
            if block_hash in self._host:
                self._host.touch(block_hash)
            else:
                saved.append((block_hash, self._codec.encode(pool[block_id])))
        return saved

    def _take(self, block_hash: BlockHash) -> torch.Tensor:
        block_size = self._codec.shape.block_size
        payload = self._host.get(block_hash)
        if payload is not None:
            self._counters.add(host_hit_tokens=block_size, host_bytes_out=payload.numel())
            return payload
        staged = self._staged.pop(block_hash, None)
        assert staged is not None, f"block {block_hash:#x} was looked up in no tier"
        self._counters.add(disk_hit_tokens=block_size, disk_bytes_out=staged.bytes_read)
        return staged.payload

    def _keep(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        spilled = self._host.put(block_hash, payload)
        if block_hash in self._host:
            self._counters.add(host_stored_blocks=1, host_bytes_in=payload.numel())
        if self._disk is None:
            return
        for spilled_hash, spilled_payload in spilled:
            if spilled_hash in self._disk:
                continue  # the disk already holds this content
            written = self._disk.put(spilled_hash, spilled_payload)
            if written:
                self._counters.add(disk_stored_blocks=1, disk_bytes_in=written)
