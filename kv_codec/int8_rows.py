"""The int8 KV pool's rows: one token's K (or V) of one kv head as int8 values and a scale.

An int8 pool (``--kv-cache-dtype int8``) is an int8 tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]``; each row::

    byte  0 .. head_dim - 1      int8 values q
          head_dim, head_dim + 1 bf16 scale s (little-endian), the row's absmax / 127 rounded up

so the row stands for ``q * s``. Why one scale per (token, kv head) rather than the
transfer's per-channel K scales (``int8.py``): decode writes one token at a time, and a
per-channel scale over a block's tokens is not known until the block is full, while a
token's own scale is known when it is written and never changes. The scale sits next to
its values: a kernel reading a row reads its scale in the same run of bytes, a block stays
one contiguous byte range (what transfer and the tiers move), and copying a row (a
speculative token's K/V moving to its position) copies its scale.

The rounding rules are ``int8.py``'s: the scale rounded up to bf16 keeps ``|x / s| <= 127``,
each value is off by at most ``s / 2``, and an all-zero row has scale 0 and stays 0. The C
kernels (``engine/csrc/paged_decode.c``) write rows by the same rules, bit for bit.
"""

from __future__ import annotations

import torch

from pdserve.kv_codec.int8 import SCALE_DTYPE, group_scales, scaled_round

ROW_SCALE_BYTES = SCALE_DTYPE.itemsize  # the bf16 scale after a row's values


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x: [..., head_dim]`` (any float dtype) -> int8 rows ``[..., head_dim + 2]``."""
    wide = x.to(torch.float32)
    scales = group_scales(wide, -1)  # bf16 [...]
    values = scaled_round(wide, scales, -1).to(torch.int8)  # exact: already integers
    return torch.cat((values, scales.unsqueeze(-1).view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 2]`` -> ``[..., head_dim]`` in ``dtype``."""
    head_dim = rows.shape[-1] - ROW_SCALE_BYTES
    scales = rows[..., head_dim:].contiguous().view(SCALE_DTYPE)  # [..., 1]
    return (rows[..., :head_dim].to(torch.float32) * scales.to(torch.float32)).to(dtype)
