"""KV tiers under the pool: blocks in host memory, then checksummed files on disk."""

from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig
from pdserve.engine.tiers.codec import BlockShape, TierCodec
from pdserve.engine.tiers.disk import DiskTier
from pdserve.engine.tiers.host import HostTier
from pdserve.engine.tiers.store import TierStore

__all__ = ["DiskTier", "HostTier", "TierCodec", "TierStore", "build_tiers"]


def build_tiers(config: CacheConfig, pool: torch.Tensor, model_id: str) -> TierStore | None:
    """The tiers ``config`` asks for around ``pool``, or None when it asks for none."""
    if config.host_tier_bytes == 0 and config.disk_tier_path is None:
        return None
    # An int8 pool's blocks are already int8: kept as they are, whatever the codec.
    name = "exact" if pool.dtype == torch.int8 else config.tier_codec
    codec = TierCodec(name, BlockShape.of_pool(pool), pool.dtype)
    disk = None
    if config.disk_tier_path is not None:
        disk = DiskTier(config.disk_tier_path, config.disk_tier_bytes, model_id, codec)
    return TierStore(HostTier(config.host_tier_bytes), disk, codec)
