"""What loading one block back into the pool costs, per tier and codec: the figures the
router's cost model weighs a hit below the pool by (``CostModel.host_load_s_per_block``,
``disk_load_s_per_block``), measured on the real pool geometry.

For each of host memory and disk, with the exact and the int8 codec: ``blocks`` random pool
blocks are evicted into the tier, then looked up and loaded back into other pool blocks
(a disk hit is read and CRC-checked at lookup, as in a prefill), timed together; the
median of ``repeats`` rounds, per block. Files live in a temporary directory (the page
cache keeps them warm, as it would for a worker's recent blocks).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.tiers import DiskTier, HostTier, TierCodec, TierStore
from pdserve.engine.tiers.codec import BlockShape

TIERS = ("host", "disk")
CODECS = ("exact", "int8")


@dataclass(slots=True, frozen=True)
class TierLoadRow:
    config: str  # e.g. "load from host, exact"
    load_ms_per_block: float


def _store(tier: str, codec: TierCodec, capacity_bytes: int, directory: Path) -> TierStore:
    if tier == "host":
        return TierStore(HostTier(capacity_bytes), None, codec)
    disk = DiskTier(directory, capacity_bytes, "bench", codec)
    return TierStore(HostTier(0), disk, codec)


def _load_round(store: TierStore, pool: torch.Tensor, hashes: range, first_dst: int) -> float:
    """Seconds to look up and load every hash of ``hashes`` into blocks from ``first_dst``."""
    started_s = time.perf_counter()
    assert all(store.holds(h) for h in hashes), "a stored block went missing"
    store.sync(pool, [], [(first_dst + i, h) for i, h in enumerate(hashes)])
    return time.perf_counter() - started_s


def measure_tier_loads(
    pool_shape: tuple[int, ...], dtype: torch.dtype, tmp: Path, blocks: int = 32, repeats: int = 3
) -> list[TierLoadRow]:
    """``pool_shape``: one block's ``[layers, 2, block_size, kv_heads, head_dim]``."""
    pool = torch.randn(2 * blocks, *pool_shape).to(dtype)
    shape = BlockShape.of_pool(pool)
    rows = []
    for tier in TIERS:
        for name in CODECS:
            codec = TierCodec(name, shape, dtype)
            capacity = 4 * blocks * (codec.payload_bytes + 4096)
            store = _store(tier, codec, capacity, tmp / f"{tier}-{name}")
            hashes = range(1, blocks + 1)
            store.sync(pool, list(zip(range(blocks), hashes, strict=True)), [])
            rounds = [_load_round(store, pool, hashes, blocks) for _ in range(repeats)]
            per_block_ms = statistics.median(rounds) / blocks * 1000
            rows.append(TierLoadRow(f"load from {tier}, {name}", per_block_ms))
    return rows
