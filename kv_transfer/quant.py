"""Optional int8 quantization of KV blocks for transfer (wire version 2): the wire records.

The quantization itself (scales per K channel and per V token, the error bound) is
``kv_codec/int8.py``, shared with the engine's cache tiers.

A quantized block record on the wire (see ``wire.py``), one contiguous byte range::

    k_scales  bf16 [num_layers, num_kv_heads, head_dim]                2*L*H*D bytes
    v_scales  bf16 [num_layers, block_size, num_kv_heads]              2*L*bs*H bytes
    values    int8 [num_layers, 2, block_size, num_kv_heads, head_dim]  L*2*bs*H*D bytes

For the default model (L=30, bs=16, H=3, D=64) that is 14,400 scale bytes + 184,320 value
bytes per block: 0.2695x of the fp32 block (the old one-scale-per-slice record: 0.2503x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kv_codec.int8 import (
    SCALE_DTYPE,
    Int8Blocks,
    dequantize_blocks,
    quantize_blocks,
    quantize_into,
)
from pdserve.kv_transfer.layout import KVPoolLayout

__all__ = [
    "SCALE_DTYPE",
    "Int8Blocks",
    "RecordFormat",
    "bytes_saved",
    "decode_records_into",
    "dequantize_blocks",
    "encode_records",
    "quantize_blocks",
    "record_bytes",
    "scales_bytes",
]


@dataclass(slots=True, frozen=True)
class RecordFormat:
    """Byte sizes of the three parts of one int8 block record, in wire order."""

    k_scales_bytes: int
    v_scales_bytes: int
    values_bytes: int

    @classmethod
    def of(cls, layout: KVPoolLayout) -> RecordFormat:
        per_layer_heads = layout.num_layers * layout.num_kv_heads * SCALE_DTYPE.itemsize
        return cls(
            per_layer_heads * layout.head_dim,
            per_layer_heads * layout.block_size,
            layout.elems_per_block,
        )

    @property
    def scales_bytes(self) -> int:
        return self.k_scales_bytes + self.v_scales_bytes

    @property
    def record_bytes(self) -> int:
        return self.scales_bytes + self.values_bytes


def record_bytes(layout: KVPoolLayout) -> int:
    """Bytes of one quantized block record (scales + int8 values)."""
    return RecordFormat.of(layout).record_bytes


def scales_bytes(layout: KVPoolLayout) -> int:
    return RecordFormat.of(layout).scales_bytes


def bytes_saved(layout: KVPoolLayout, num_blocks: int) -> int:
    """Bytes int8 transfer saves over sending ``num_blocks`` blocks in the pool dtype."""
    return num_blocks * (layout.block_bytes - record_bytes(layout))


def encode_records(blocks: torch.Tensor, layout: KVPoolLayout) -> torch.Tensor:
    """Quantize blocks into wire records: uint8 [n, record_bytes(layout)]."""
    n, fmt = blocks.shape[0], RecordFormat.of(layout)
    records = torch.empty((n, fmt.record_bytes), dtype=torch.uint8)
    values = records[:, fmt.scales_bytes :].view(torch.int8).view(blocks.shape)
    k_scales, v_scales = quantize_into(blocks, values)
    k_end = fmt.k_scales_bytes
    records[:, :k_end] = k_scales.reshape(n, -1).view(torch.uint8)
    records[:, k_end : fmt.scales_bytes] = v_scales.reshape(n, -1).view(torch.uint8)
    return records


def decode_records_into(
    records: torch.Tensor, pool: torch.Tensor, dst_block_ids: list[int], layout: KVPoolLayout
) -> None:
    """Dequantize wire records (uint8 [n, record_bytes]) into ``pool[dst_block_ids]``."""
    n, fmt = records.shape[0], RecordFormat.of(layout)
    assert n == len(dst_block_ids), f"{n} records for {len(dst_block_ids)} destination blocks"
    assert records.shape[1] == fmt.record_bytes, (
        f"records of {records.shape[1]} bytes, the int8 format has {fmt.record_bytes}"
    )
    layers, heads = layout.num_layers, layout.num_kv_heads
    k_end = fmt.k_scales_bytes
    q = Int8Blocks(
        values=_part(records, fmt.scales_bytes, fmt.record_bytes, torch.int8).reshape(
            n, *layout.block_shape
        ),
        k_scales=_part(records, 0, k_end, SCALE_DTYPE).reshape(n, layers, heads, -1),
        v_scales=_part(records, k_end, fmt.scales_bytes, SCALE_DTYPE).reshape(
            n, layers, layout.block_size, heads
        ),
    )
    index = torch.tensor(dst_block_ids, dtype=torch.long)
    deq = dequantize_blocks(q, pool.dtype)  # [n, L, 2, bs, H, D]
    pool.index_copy_(0, index, deq)


def _part(records: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, end)`` of every record, as a contiguous [n, -1] tensor of ``dtype``."""
    return records[:, start:end].contiguous().view(dtype)
