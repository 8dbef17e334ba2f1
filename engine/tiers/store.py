"""The tiers under the KV pool, composed: host memory, then disk.

The engine calls :meth:`TierStore.sync` once the scheduler has planned a step and before the
runner writes the pool: blocks the pool evicted are read (encoded by the codec) first, then
tier hits are loaded into their fresh blocks (which may be the evicted ones), then the
evicted blocks are kept in host memory, whose overflow goes to disk. Loads are synchronous.

A disk hit is read and checked before the lookup counts it (:meth:`TierStore.holds`) and
staged until the step's loads, so a load never meets a file that failed its checksum. The
read starts when the prompt arrives (:meth:`TierStore.prefetch`, on a thread of its own), so
that it overlaps the steps that run while the prompt waits; the lookup then finds it done.

Every block whose place may have changed (evicted from the pool, pushed from host memory to
disk, dropped) is listed for :meth:`TierStore.take_moved`: the KV events tell the locality
index where it went.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import KVTier, TierStats
from pdserve.engine.tiers.codec import TierCodec
from pdserve.engine.tiers.disk import DiskTier, ReadResult
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
        # Disk reads started ahead of their lookup (prefetch); one thread: reads in order.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-tier")
        self._reading: dict[BlockHash, Future[ReadResult]] = {}
        self._counters = _Counters()
        self._moved: list[BlockHash] = []

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Start reading the disk blocks among ``block_hashes`` (a prompt's, when it arrives)
        on a thread of the tier's own, so that the lookup that admits the prompt finds them
        read and checked rather than reading them on the step's path."""
        if self._disk is None:
            return
        for block_hash in block_hashes:
            if block_hash in self._host or block_hash in self._staged:
                continue
            if block_hash not in self._disk:
                break  # a prefix: the lookup stops at the first block no tier holds
            if block_hash not in self._reading:
                self._reading[block_hash] = self._reader.submit(self._disk.read, block_hash)

    def holds(self, block_hash: BlockHash) -> bool:
        if block_hash in self._host or block_hash in self._staged:
            return True
        reading = self._reading.pop(block_hash, None)
        if self._disk is None or block_hash not in self._disk:
            return False
        result = reading.result() if reading is not None else self._disk.read(block_hash)
        found = self._disk.accept(block_hash, result)
        if found is None:
            return False
        self._staged[block_hash] = _Staged(*found)
        return True

    def tier_of(self, block_hash: BlockHash) -> KVTier | None:
        if block_hash in self._host:
            return KVTier.HOST
        if self._disk is not None and block_hash in self._disk:
            return KVTier.DISK
        return None

    def block_hashes(self, tier: KVTier) -> Iterable[BlockHash]:
        if tier is KVTier.HOST:
            return list(self._host)
        assert tier is KVTier.DISK, f"the tiers under the pool are host and disk, not {tier!r}"
        return list(self._disk) if self._disk is not None else []

    def take_moved(self) -> list[BlockHash]:
        moved, self._moved = self._moved, []
        if self._disk is not None:
            moved += self._disk.take_dropped()
        return moved

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
            self._moved.append(block_hash)
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
        self._moved += [h for h, _ in spilled]
        if self._disk is None:
            return
        for spilled_hash, spilled_payload in spilled:
            if spilled_hash in self._disk:
                continue  # the disk already holds this content
            written = self._disk.put(spilled_hash, spilled_payload)
            if written:
                self._counters.add(disk_stored_blocks=1, disk_bytes_in=written)
