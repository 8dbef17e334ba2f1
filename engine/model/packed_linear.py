"""Linear layers with weights packed once for CPU inference.

A step runs every linear layer on ``T`` rows, where ``T`` is the number of decoding
sequences (often 4..64) or a prefill chunk (up to the token budget). For small ``T`` the
default BLAS path reads the weights at half the memory bandwidth or less. Packed once into a
layout the GEMM reads front to back, the weights serve every ``T``:

- fp32: our own GEMM (``engine/csrc/packed_gemm.c``), 1.15-1.40x faster than oneDNN's packed
  fp32 GEMM for 1-64 rows, level to 9% slower from 256 rows up (SmolLM2's layer linears,
  two threads, ``python -m pdserve.bench.packed_gemm``), level at 2,048 since outputs of 2 MiB or
  more are streamed (``stream_store.h``: 0.95-0.96x before, 1.00x after, 2026-11-26);
  oneDNN when it cannot be built.
- bf16: our own AMX GEMM (``engine/csrc/amx_gemm.c``) where the CPU has AMX and the input
  size is a multiple of 32; else our own AVX-512 BF16 GEMM (``avx512_bf16_gemm.c``) where
  the CPU has AVX-512 BF16 and the input size is even: on a Zen 4, 1.14-1.53x faster than
  oneDNN's for 1-64 rows, level at 128-256, 0.99x at 2,048 with big outputs streamed
  (0.94-0.95x before; ``python -m pdserve.bench.packed_gemm --dtype bf16``, 2026-11-26), and
  batch-invariant (with oneDNN's, the engine's bf16 tokens depended on the batch); oneDNN
  otherwise.

All apply an element-wise op to the GEMM result before storing it (a "post-op"), which
saves the separate passes over the activations for SiLU, the gate product and the residual
adds; on our GEMMs the MLP's gate and up are even one GEMM, see :class:`PackedMLP`.

The packed weight replaces the plain one (no second copy), so a packed model's
``state_dict`` holds packed tensors: pack only models that serve
(:meth:`pdserve.engine.model.llama.LlamaModel.pack_linears`), never ones that are saved.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.host_memory import on_huge_pages
from pdserve.engine.model.packed_gemm import SWIGLU_GROUP, PackedGemm, gemm_for, swiglu_rows


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN serves CPU fp32 and bf16 linears when torch was built with it."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with the weight in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._gemm: PackedGemm | None = native_gemm(weight)
        if self._gemm is not None:
            self.packed_weight = self._gemm.pack(weight.detach())
        else:  # oneDNN's opaque blocked layout, for any row count (batch-size hint None)
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach().clone()  # not a view of the loader's

    @property
    def gemm(self) -> PackedGemm | None:
        """Our GEMM holding the packed weight, or None: oneDNN's."""
        return self._gemm

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        """``x: [T, in]`` -> ``[T, out]``; ``activation="swish"`` applies SiLU in the GEMM;
        ``"swiglu"`` (our GEMMs only, a weight built by ``swiglu_rows``) -> ``[T, out / 2]``,
        ``silu(gate) * up``."""
        if self._gemm is not None:
            return self._gemm.linear(
                x, self.packed_weight, self.out_features, self.bias, activation
            )
        linear = torch.ops.mkldnn._linear_pointwise
        return linear(x, self.packed_weight, self.bias, activation, [], "")

    def forward_binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """``(x @ W.T + b) <op> other`` in one pass, ``op`` one of ``"add"``, ``"mul"``;
        ``other: [T, out]``."""
        if self._gemm is not None:
            return self._gemm.linear(x, self.packed_weight, self.out_features, self.bias, op, other)
        return torch.ops.mkldnn._linear_pointwise.binary(
            x, other, self.packed_weight, self.bias, op
        )


class PackedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` as packed GEMMs with fused post-ops, the
    residual add inside ``down``. On our GEMMs: gate and up are one GEMM whose post-op is
    ``silu(gate) * up`` (the gate never goes to memory). On oneDNN's, two: SiLU inside the
    gate GEMM, the product inside the up GEMM."""

    def __init__(
        self,
        gate_up_weight: torch.Tensor,  # [2 * intermediate, hidden]: gate rows, then up rows
        gate_up_bias: torch.Tensor | None,
        down: nn.Linear,
    ) -> None:
        super().__init__()
        gate_w, up_w = gate_up_weight.detach().chunk(2)
        gate_b, up_b = (None, None) if gate_up_bias is None else gate_up_bias.detach().chunk(2)
        self.gate_up: PackedLinear | None = None  # the one-GEMM form
        self.gate: PackedLinear | None = None  # the two-GEMM form
        self.up: PackedLinear | None = None
        if native_gemm(gate_w) is not None and gate_w.shape[0] % SWIGLU_GROUP == 0:
            bias = None if gate_b is None or up_b is None else swiglu_rows(gate_b, up_b)
            self.gate_up = PackedLinear(swiglu_rows(gate_w, up_w), bias)
        else:
            self.gate, self.up = PackedLinear(gate_w, gate_b), PackedLinear(up_w, up_b)
        self.down = PackedLinear(down.weight, down.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``; ``x``, ``residual``: [T, hidden]."""
        if self.gate_up is not None:
            hidden = self.gate_up(x, activation="swiglu")  # [T, intermediate]
        else:
            assert self.gate is not None and self.up is not None
            gate = self.gate(x, activation="swish")  # [T, intermediate]
            hidden = self.up.forward_binary(x, gate, "mul")
        return self.down.forward_binary(hidden, residual, "add")


def gather_on_huge_pages(model: nn.Module) -> None:
    """Move the weights our GEMMs packed in ``model`` side by side onto huge pages.

    A decode step reads every weight once, front to back, a few rows at a time: on 4 KiB
    pages each 4 KiB costs a TLB miss, and the CPU's prefetchers stop at every page's end.
    Measured gain (Zen 4, two threads, 2026-11-26, ``python -m pdserve.bench.packed_gemm --dtype
    bf16 [--huge-pages]``, alternating): 4-7% at 1-32 rows in one pair of runs; in the other
    level at 1-32 rows, 5% at 48; a stand-alone C loop over the same GEMMs, 3-10% at 8-32. The
    KV pool gained 7-9% the same way (``engine/host_memory.py``). oneDNN's packed weights
    stay where they are.
    """
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.gemm is not None]
    moved = on_huge_pages([linear.packed_weight for linear in linears])
    for linear, weight in zip(linears, moved, strict=True):
        linear.packed_weight = weight


def native_gemm(weight: torch.Tensor) -> PackedGemm | None:
    """Our GEMM for this weight (its dtype and input size), or None: oneDNN's."""
    gemm = gemm_for(weight.dtype)
    return gemm if gemm is not None and gemm.handles(weight.shape[1]) else None


def project_add(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + proj(x)``; a packed projection does the add inside its GEMM."""
    if isinstance(proj, PackedLinear):
        return proj.forward_binary(x, residual, "add")
    return residual + proj(x)
