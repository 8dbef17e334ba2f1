"""Blocks of one pool format as another's: what a sender does for a receiver of the other kind.

A receiver always gets blocks in its own pool's format. Between a float pool (fp32, bf16)
and an int8 pool (``kv_codec/int8_rows.py``: int8 rows with a scale each) of the same K/V
shape, the sender converts: it quantizes its blocks to the int8 pool's rows, or dequantizes
its int8 rows to the float pool's dtype, and sends them as that pool's own (plain) records.
Between two int8 pools nothing is converted: the blocks move as they are, int8 and scales.
"""

from __future__ import annotations

import torch

from pdserve.kv_codec import dequantize_rows, quantize_rows
from pdserve.kv_transfer.layout import KVPoolLayout

CHUNK_BLOCKS = 16  # blocks converted at a time, to bound the memory a conversion takes


def converts(ours: KVPoolLayout, peer: KVPoolLayout) -> bool:
    """Whether blocks of ``ours`` go to ``peer`` converted (see the module docstring)."""
    one_int8 = (ours.dtype == torch.int8) != (peer.dtype == torch.int8)
    return one_int8 and ours.block_shape == peer.block_shape


def convert_blocks(blocks: torch.Tensor, to: KVPoolLayout) -> torch.Tensor:
    """``blocks`` ``[n, *pool block]`` of the other format (see :func:`converts`) in ``to``'s."""
    if to.dtype == torch.int8:
        return quantize_rows(blocks)
    return dequantize_rows(blocks, to.dtype)
