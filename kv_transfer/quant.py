"""Optional int8 quantization of KV blocks for transfer.

One float32 scale per (block, layer, K/V): ``scale = absmax / 127`` over that slice's
``[block_size, num_kv_heads, head_dim]`` values, ``q = round(x / scale)`` clamped to
[-127, 127]. Dequantizing gives ``q * scale``, so each element is off by at most
``scale / 2 = absmax / 254`` (plus the rounding of the receiver's pool dtype).

A quantized block record on the wire (see ``wire.py``)::

    scales  float32 [num_layers, 2]                                  8 * num_layers bytes
    values  int8    [num_layers, 2, block_size, num_kv_heads, head_dim]

so one record is still a single contiguous byte range.
"""

from __future__ import annotations

import torch

from kv_transfer.layout import KVPoolLayout

_QMAX = 127.0


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``blocks: [n, num_layers, 2, block_size, heads, head_dim]`` to int8.

    Returns ``(values, scales)``: values int8 of the same shape, scales float32 [n, L, 2].
    """
    q, scales = _scaled(blocks)
    return q.to(torch.int8), scales


def _scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(x / scale)`` clamped to +-127, as float32, and the scales [n, L, 2]."""
    x = blocks.to(torch.float32)
    # max(|max|, |min|) reads x twice but allocates no |x| copy: this path is memory-bound.
    absmax = torch.maximum(x.amax(dim=(3, 4, 5)), x.amin(dim=(3, 4, 5)).neg_())  # [n, L, 2]
    scales = absmax / _QMAX
    # An all-zero slice has scale 0; divide by 1 there so it stays exactly 0.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.div(x, safe[..., None, None, None]).round_().clamp_(-_QMAX, _QMAX)
    return q, scales


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: values [n, L, 2, bs, H, D] int8, scales [n, L, 2]."""
    x = values.to(torch.float32).mul_(scales[..., None, None, None])
    return x.to(out_dtype)


def record_bytes(layout: KVPoolLayout) -> int:
    """Bytes of one quantized block record (scales + int8 values)."""
    return scales_bytes(layout) + layout.elems_per_block


def scales_bytes(layout: KVPoolLayout) -> int:
    return layout.num_layers * 2 * 4


def bytes_saved(layout: KVPoolLayout, num_blocks: int) -> int:
    """Bytes int8 transfer saves over sending ``num_blocks`` blocks in the pool dtype."""
    return num_blocks * (layout.block_bytes - record_bytes(layout))


def encode_records(blocks: torch.Tensor, layout: KVPoolLayout) -> torch.Tensor:
    """Quantize blocks into wire records: uint8 [n, record_bytes(layout)]."""
    q, scales = _scaled(blocks)
    n = blocks.shape[0]
    records = torch.empty((n, record_bytes(layout)), dtype=torch.uint8)
    split = scales_bytes(layout)
    records[:, :split] = scales.reshape(n, -1).view(torch.uint8)
    records[:, split:].view(torch.int8).copy_(q.reshape(n, -1))  # float -> int8, exact
    return records


def decode_records_into(
    records: torch.Tensor, pool: torch.Tensor, dst_block_ids: list[int], layout: KVPoolLayout
) -> None:
    """Dequantize wire records (uint8 [n, record_bytes]) into ``pool[dst_block_ids]``."""
    n = records.shape[0]
    assert n == len(dst_block_ids), f"{n} records for {len(dst_block_ids)} destination blocks"
    split = scales_bytes(layout)
    scales = records[:, :split].contiguous().view(torch.float32).reshape(n, layout.num_layers, 2)
    values = records[:, split:].contiguous().view(torch.int8).reshape(n, *layout.block_shape)
    index = torch.tensor(dst_block_ids, dtype=torch.long)
    pool.index_copy_(0, index, dequantize_blocks(values, scales, pool.dtype))
