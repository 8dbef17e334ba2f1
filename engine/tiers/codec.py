"""How a tier keeps one pool block: as the pool's own bytes, or quantized to int8.

Both codecs turn a block ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` into one
flat ``uint8`` payload, so host memory, disk files and their byte accounting need not know
which codec made it:

- ``exact`` (the default) copies the block's bytes: a block that comes back is bit for bit
  the one that left, so tiers, like the prefix cache, never change a token (an int8 pool's
  blocks, values and scales, are always kept so: ``build_tiers``);
- ``int8`` keeps the transfer's int8 quantization (``kv_codec``: per-channel K, per-token V
  scales), 0.53x the bytes of a bf16 block and 0.27x of fp32, so the same memory holds about
  twice (four times) the blocks; it is not bit-exact (``docs/benchmarks.md``, "KV tiers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import TIER_CODECS
from pdserve.kv_codec import SCALE_DTYPE, Int8Blocks, dequantize_blocks, quantize_blocks


@dataclass(slots=True, frozen=True)
class BlockShape:
    """One block's shape: ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (an int8
    pool's ``head_dim`` is its rows' bytes, values and scale)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, pool: torch.Tensor) -> BlockShape:
        _num_blocks, layers, _two, block_size, heads, head_dim = pool.shape
        return cls(layers, block_size, heads, head_dim)

    @property
    def elements(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim


@dataclass(slots=True, frozen=True)
class TierCodec:
    """``name`` (one of ``TIER_CODECS``) for blocks of ``shape`` from a pool of ``dtype``.

    ``tag`` names the payload's format in disk files: a file written by another codec, or
    by the exact codec of another dtype, cannot be read back by this one.
    """

    name: str
    shape: BlockShape
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.name not in TIER_CODECS:
            raise ValueError(f"tier codec must be one of {TIER_CODECS}, got {self.name!r}")

    @property
    def tag(self) -> str:
        return "int8" if self.name == "int8" else f"exact-{str(self.dtype).removeprefix('torch.')}"

    @property
    def payload_bytes(self) -> int:
        s = self.shape
        if self.name == "exact":
            return s.elements * self.dtype.itemsize
        scales = s.num_layers * s.num_kv_heads * (s.head_dim + s.block_size)
        return scales * SCALE_DTYPE.itemsize + s.elements

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (one pool block, on any device) as a new flat ``uint8`` payload in host
        memory: the tiers are host memory and disk."""
        if self.name == "exact":
            return block.reshape(-1).view(torch.uint8).to("cpu", copy=True)
        q = quantize_blocks(block.unsqueeze(0))
        payload = torch.cat(
            [t.reshape(-1).view(torch.uint8) for t in (q.k_scales, q.v_scales, q.values)]
        )
        return payload.cpu()

    def decode_into(self, payload: torch.Tensor, block: torch.Tensor) -> None:
        """Write the block ``payload`` holds into ``block`` (a pool block of ``dtype``, on any
        device)."""
        if self.name == "exact":
            block.copy_(payload.view(self.dtype).view(block.shape))
            return
        block.copy_(dequantize_blocks(self._int8(payload), block.dtype)[0])

    def _int8(self, payload: torch.Tensor) -> Int8Blocks:
        s = self.shape
        k_end = s.num_layers * s.num_kv_heads * s.head_dim * SCALE_DTYPE.itemsize
        v_end = k_end + s.num_layers * s.block_size * s.num_kv_heads * SCALE_DTYPE.itemsize
        return Int8Blocks(
            values=payload[v_end:]
            .view(torch.int8)
            .reshape(1, s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim),
            k_scales=payload[:k_end]
            .view(SCALE_DTYPE)
            .reshape(1, s.num_layers, s.num_kv_heads, s.head_dim),
            v_scales=payload[k_end:v_end]
            .view(SCALE_DTYPE)
            .reshape(1, s.num_layers, s.block_size, s.num_kv_heads),
        )
