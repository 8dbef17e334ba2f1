"""What the tiers keep of a pool block, a record of bytes, and how it goes back into the pool.

* A float pool's (fp32, bf16) blocks are quantized: the record is the transfer's int8 record
  (``kv_codec/int8.py``: bf16 K scales per channel, V scales per token, then int8 values),
  dequantized into the pool's dtype on the way back.
* An int8 pool's blocks (``kv_codec/int8_rows.py``) are kept as they are: the record is the
  block's bytes, values and scales, and goes back unchanged, so a block that leaves for the
  tiers and returns is the block that left.

The host tier holds records, the disk tier writes them as file payloads; only the codec knows
what is inside. :func:`codec_for` picks one by the pool's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.tiers.disk_format import BlockShape
from pdserve.kv_codec import SCALE_DTYPE, Int8Blocks, dequantize_blocks, quantize_blocks


class TierCodec(Protocol):
    """A pool block as a record (uint8 ``[record_bytes]``) and back."""

    @property
    def shape(self) -> BlockShape:
        """The pool block's shape (an int8 pool's ``head_dim`` counts its rows' bytes)."""
        ...

    def record_bytes(self) -> int: ...

    def capture(self, pool: torch.Tensor, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of ``pool`` as a new record."""
        ...

    def restore(self, record: torch.Tensor, pool: torch.Tensor, block_id: int) -> None:
        """Write ``record`` into block ``block_id`` of ``pool``."""
        ...


@dataclass(slots=True, frozen=True)
class QuantizedRecords:
    """A float pool's blocks, quantized to the transfer's int8 record."""

    shape: BlockShape

    def record_bytes(self) -> int:
        return self.shape.payload_bytes()

    def capture(self, pool: torch.Tensor, block_id: int) -> torch.Tensor:
        q = quantize_blocks(pool[block_id : block_id + 1])
        parts = (q.k_scales, q.v_scales, q.values)
        return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])

    def restore(self, record: torch.Tensor, pool: torch.Tensor, block_id: int) -> None:
        pool[block_id] = dequantize_blocks(self._blocks(record), pool.dtype)[0]

    def _blocks(self, record: torch.Tensor) -> Int8Blocks:
        layers, bs, heads, dim = (
            self.shape.num_layers,
            self.shape.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        )
        k_end = layers * heads * dim * SCALE_DTYPE.itemsize
        v_end = k_end + layers * bs * heads * SCALE_DTYPE.itemsize
        return Int8Blocks(
            values=record[v_end:].view(torch.int8).reshape(1, layers, 2, bs, heads, dim),
            k_scales=record[:k_end].view(SCALE_DTYPE).reshape(1, layers, heads, dim),
            v_scales=record[k_end:v_end].view(SCALE_DTYPE).reshape(1, layers, bs, heads),
        )


@dataclass(slots=True, frozen=True)
class StoredBlocks:
    """An int8 pool's blocks, byte for byte."""

    shape: BlockShape

    def record_bytes(self) -> int:
        s = self.shape
        return s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim

    def capture(self, pool: torch.Tensor, block_id: int) -> torch.Tensor:
        return pool[block_id].reshape(-1).view(torch.uint8).clone()

    def restore(self, record: torch.Tensor, pool: torch.Tensor, block_id: int) -> None:
        pool[block_id].view(-1).copy_(record.view(torch.int8))


def codec_for(pool: torch.Tensor) -> TierCodec:
    """The codec of ``pool``'s blocks: kept as they are in an int8 pool, else quantized."""
    shape = BlockShape.of_pool(pool)
    return StoredBlocks(shape) if pool.dtype == torch.int8 else QuantizedRecords(shape)
