"""Rotary position embedding in the Hugging Face ("rotate half") layout.

Head dimension ``d`` pairs ``x[i]`` with ``x[i + d/2]`` and rotates the pair by
``position * inv_freq[i]``. GGUF files from llama.cpp store Llama's Q/K weights permuted for
the interleaved layout (pairs ``2i, 2i+1``); the loader undoes that, so this one layout serves
GGUF and safetensors alike.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.model.config import ModelConfig, RopeScaling
from pdserve.engine.model.fused_ops import fused_ops


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies, after any context-extension scaling.

    ``freq_factors`` are llama.cpp's per-frequency divisors (the ``rope_freqs`` tensor of a
    Llama 3 GGUF); they replace the ``llama3`` formula when present.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if freq_factors is not None:
        return inv_freq / freq_factors.float()
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for positions ``0 .. max_positions - 1``, indexed per token."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        angles = torch.outer(positions, inv_freq.float())  # [max_positions, head_dim / 2]
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped ``[T, 1, head_dim / 2]`` to broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context of "
                f"{self.cos.shape[0]} tokens"
            )
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, heads, head_dim]`` by per-token ``cos/sin: [T, 1, head_dim / 2]``."""
    ops = fused_ops()
    rotated = None if ops is None else ops.rope(x, cos, sin)
    return rotated if rotated is not None else apply_rope_torch(x, cos, sin)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in torch ops, for what the fused op does not take."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
