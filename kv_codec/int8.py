"""int8 quantization of KV blocks with per-channel K and per-token V scales.

Scales follow the statistics of each half (KIVI-style), because K has a few outlier
channels: one scale for a whole (block, layer, K/V) slice spends most of the int8 range on
them and rounds every other channel coarsely (measured on SmolLM2: greedy output diverged
in 5 of 8 prompts). So, per block:

- K: one scale per (layer, kv_head, channel), over the block's ``block_size`` tokens;
- V: one scale per (layer, token, kv_head), over the ``head_dim`` channels.

``scale = absmax / 127`` of its group, rounded *up* to bfloat16 (bf16 keeps fp32's range,
so no KV value can overflow its scale, and rounding up keeps ``|x / scale| <= 127``);
``q = round(x / scale)`` clamped to [-127, 127]; dequantizing gives ``q * scale``. Each
element is off by at most ``scale / 2 <= (absmax / 254) * (1 + 2**-7)`` of its group, plus
the rounding of the destination pool's dtype. An all-zero group has scale 0 and stays 0.

KV transfer (``kv_transfer/quant.py``) lays these out as wire records; the engine's host and
disk tiers (``engine/tiers/``) keep evicted blocks in this form when their codec is ``int8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_QMAX = 127.0
SCALE_DTYPE = torch.bfloat16
# Dims of one half (K or V) of blocks, x: [n, num_layers, block_size, num_kv_heads, head_dim].
_TOKEN_DIM = 2  # K's scales reduce over it
_CHANNEL_DIM = 4  # V's scales reduce over it


@dataclass(slots=True, frozen=True)
class Int8Blocks:
    """Quantized blocks: ``values * scales`` (broadcast per half) approximates the blocks."""

    values: torch.Tensor  # int8 [n, num_layers, 2, block_size, num_kv_heads, head_dim]
    k_scales: torch.Tensor  # bf16 [n, num_layers, num_kv_heads, head_dim]
    v_scales: torch.Tensor  # bf16 [n, num_layers, block_size, num_kv_heads]


def quantize_blocks(blocks: torch.Tensor) -> Int8Blocks:
    """Quantize ``blocks: [n, num_layers, 2, block_size, heads, head_dim]`` to int8."""
    values = torch.empty(blocks.shape, dtype=torch.int8)
    k_scales, v_scales = quantize_into(blocks, values)
    return Int8Blocks(values, k_scales, v_scales)


def quantize_into(blocks: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write int8 ``values`` (same shape as ``blocks``, may be a view into wire records);
    return the bf16 ``(k_scales [n, L, H, D], v_scales [n, L, bs, H])``."""
    x = blocks.to(torch.float32)
    k_scales = group_scales(x[:, :, 0], _TOKEN_DIM)
    v_scales = group_scales(x[:, :, 1], _CHANNEL_DIM)
    values[:, :, 0] = scaled_round(x[:, :, 0], k_scales, _TOKEN_DIM)  # float -> int8, exact
    values[:, :, 1] = scaled_round(x[:, :, 1], v_scales, _CHANNEL_DIM)
    return k_scales, v_scales


def group_scales(half: torch.Tensor, dim: int) -> torch.Tensor:
    """bf16 ``absmax / 127`` over ``dim`` of ``half``, rounded up (see the module doc)."""
    # max(|max|, |min|) reads the data twice but allocates no |x| copy: this is memory-bound.
    absmax = torch.maximum(half.amax(dim=dim), half.amin(dim=dim).neg_())
    # + 0.0 turns the -0.0 of an all-zero group (-min) into +0.0: the scale is 0, not -0.
    exact = absmax / _QMAX + 0.0
    nearest = exact.to(SCALE_DTYPE)
    # For a positive finite bf16, bits + 1 is the next larger bf16.
    up = (nearest.view(torch.int16) + 1).view(SCALE_DTYPE)
    return torch.where(nearest.to(torch.float32) < exact, up, nearest)


def scaled_round(half: torch.Tensor, scales: torch.Tensor, dim: int) -> torch.Tensor:
    """``round(half / scale)`` clamped to +-127, as float32 (scales broadcast over ``dim``)."""
    wide = scales.to(torch.float32).unsqueeze(dim)
    # A zero scale means an all-zero group: divide by 1 there so it stays exactly 0.
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    return torch.div(half, safe).round_().clamp_(-_QMAX, _QMAX)


def dequantize_blocks(q: Int8Blocks, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: [n, L, 2, bs, H, D] in ``out_dtype``."""
    x = q.values.to(torch.float32)
    x[:, :, 0].mul_(q.k_scales.to(torch.float32).unsqueeze(_TOKEN_DIM))
    x[:, :, 1].mul_(q.v_scales.to(torch.float32).unsqueeze(_CHANNEL_DIM))
    return x.to(out_dtype)
