"""Inputs of the fused RMSNorm and RoPE, shared by the tests of their C and Triton kernels:
seeded by the token count, laid out as the model hands them over."""

from __future__ import annotations

import torch

from pdserve.engine.model.llama import RMSNorm


def rope_inputs(
    tokens: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qk, cos, sin)``: the query and key heads of a fused QKV projection's rows, a
    strided view ``[tokens, heads + kv_heads, head_dim]``, and the cosines and sines
    ``[tokens, 1, head_dim // 2]`` of random angles."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 100
    return qk, angles.cos().to(dtype), angles.sin().to(dtype)


def rms_norm_inputs(
    tokens: int, hidden: int, dtype: torch.dtype, row_width: int | None = None
) -> tuple[RMSNorm, torch.Tensor]:
    """A norm of ``hidden`` weights in [0.5, 1.5) and its input ``[tokens, hidden]``: the
    first ``hidden`` columns of rows ``row_width`` wide (dense rows by default)."""
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    rows = torch.randn(tokens, row_width or hidden, generator=gen) * 3
    return norm.to(dtype), rows.to(dtype)[:, :hidden]
