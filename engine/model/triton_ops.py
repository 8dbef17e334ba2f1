"""RMSNorm and RoPE on CUDA, one Triton kernel each (the CPU has ``fused_ops.c``).

In torch each is several kernels over the activations (RoPE: four products, two sums and a
concatenation; RMSNorm in bf16: the norm, then the scale); here each is one read and one
write. The rounding follows the torch code they replace (``llama.py``'s
``RMSNorm.torch_forward``, ``rope.py``'s ``apply_rope_torch``): every product and sum is
computed in fp32 and rounded to the tensor's dtype where torch's separate kernels round.

Imported only by :func:`pdserve.engine.model.fused_ops.cuda_fused_ops`, so nothing imports
Triton until a CUDA tensor needs it. Not yet run on a GPU: the tests run these kernels under
Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, x_row_stride, eps, COLS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < COLS
    x = tl.load(x_ptr + row * x_row_stride + col, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / COLS + eps)
    # Normalised in fp32, rounded to the dtype, then scaled and rounded again (a no-op in fp32).
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * COLS + col, (normed * weight).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (head < HEADS) & (i < HALF)
    first = (
        x_ptr + token * x_token_stride + head * x_head_stride + i
    )  # x[i], paired with x[i + d/2]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out = out_ptr + token * (HEADS * 2 * HALF) + head * (2 * HALF) + i
    tl.store(out, out1.to(dtype), mask=ok)
    tl.store(out + HALF, out2.to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x: [T, hidden]`` (rows dense) normalised and scaled by ``weight``, into a new tensor."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), eps, COLS=cols, BLOCK=block)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, heads, head_dim]`` (rows dense) rotated by dense ``cos``/``sin: [T, 1,
    head_dim / 2]`` into a new dense tensor."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        _rope_kernel[(tokens,)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            HEADS=heads,
            HALF=head_dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return out
