"""A decode step's decoder layers as one flat run of C calls, when every kernel is ours.

Why: through the torch modules a layer costs ~25 Python-level operations (module calls,
checks, tensor allocations, views) around its 9 C calls; a decode step of 48 sequences spent
4.2 of its 35 ms there (bf16, warm, Zen 4), and in a full run that Python code runs with its
caches emptied by the kernels in between. Here the same C calls, in the same order and with
the same arguments, run on six buffers allocated once per step, the checks done once per
step (the step's tensors) or once per model (the weights): that step 31-37 ms against 35-44
through the modules (alternating), the whole bf16 benchmark workload 4 s (6%) faster
(``docs/benchmarks.md``). The results are bit-identical (``tests/integration/
test_native_step.py``: logits and the K/V written).

Used for steps of decode tokens only (the attention backend's ``bind_native_decode``) on
models whose every linear is one of our packed GEMMs with the MLP as one SwiGLU GEMM, with
the fused RMSNorm and RoPE; anything else runs through the modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.fused_ops import FusedOps, fused_ops
from pdserve.engine.model.packed_gemm import OPS, PackedGemm
from pdserve.engine.model.packed_linear import PackedLinear, PackedMLP

if TYPE_CHECKING:
    from pdserve.engine.attention.native import BoundDecode
    from pdserve.engine.model.llama import DecoderLayer


@dataclass(slots=True, frozen=True)
class _LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear  # the SwiGLU form: silu(gate) * up out of one GEMM
    down: PackedLinear


@dataclass(slots=True, frozen=True)
class NativeDecodeLayers:
    """Runs a model's decoder layers on our C kernels alone (see the module docstring)."""

    config: ModelConfig
    gemm: PackedGemm
    ops: FusedOps
    layers: list[_LayerWeights]
    eps: float  # every norm's

    @classmethod
    def for_layers(
        cls, config: ModelConfig, layers: Sequence[DecoderLayer]
    ) -> NativeDecodeLayers | None:
        """The runner for these (packed) layers, or None when some part is not ours."""
        ops = fused_ops()
        weights: list[_LayerWeights] = []
        for layer in layers:
            w = _layer_weights(layer)
            if w is None:
                return None
            weights.append(w)
        if ops is None or not weights:
            return None
        hidden, inter, q_size = config.hidden_size, config.intermediate_size, config.q_size
        qkv_width = q_size + 2 * config.kv_size
        shapes = [(hidden, qkv_width), (q_size, hidden), (hidden, 2 * inter), (inter, hidden)]
        gemms: set[PackedGemm | None] = set()
        for w in weights:
            linears = (w.qkv, w.o, w.gate_up, w.down)
            found = [(linear.in_features, linear.out_features) for linear in linears]
            assert found == shapes, f"layer linears {found}, config {shapes}"
            gemms.update(linear.gemm for linear in linears)
        gemm = gemms.pop()
        epsilons = {n.eps for layer in layers for n in (layer.input_norm, layer.post_attn_norm)}
        norm_dtypes = {n.dtype for w in weights for n in (w.input_norm, w.post_attn_norm)}
        if gemms or gemm is None or len(epsilons) != 1 or norm_dtypes != {gemm.dtype}:
            return None  # mixed GEMMs or oneDNN's, per-layer eps, norms of another dtype
        return cls(config, gemm, ops, weights, epsilons.pop())

    def run(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream; updated in place
        cos: torch.Tensor,  # [T, 1, head_dim / 2]
        sin: torch.Tensor,
        step: BoundDecode,  # the step's K/V store and attention of its T rows
    ) -> torch.Tensor:
        """``x`` after every decoder layer (the final norm is the caller's)."""
        config = self.config
        tokens, hidden = x.shape
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        dtype = self.gemm.dtype
        # The C calls below trust every address: check the step's tensors here, once.
        assert x.dtype == cos.dtype == sin.dtype == dtype, f"{x.dtype}, {cos.dtype}, {dtype}"
        assert x.is_contiguous() and hidden == config.hidden_size, f"x {tuple(x.shape)}"
        assert cos.is_contiguous() and sin.is_contiguous(), "cos/sin not dense"
        assert cos.shape == sin.shape == (tokens, 1, head_dim // 2), f"cos {tuple(cos.shape)}"
        assert step.num_seqs + step.num_more_rows == step.num_tokens == tokens, (
            f"{step.num_seqs} decode rows and {step.num_more_rows} more for {tokens} tokens"
        )
        assert (step.num_heads, step.kv_heads, step.head_dim) == (heads, kv_heads, head_dim)
        rotated = heads + kv_heads  # q and k heads, rotated together
        qkv_width = (rotated + kv_heads) * head_dim
        inter = config.intermediate_size
        residual = torch.empty_like(x)  # x + attention, before the MLP adds to it
        normed = torch.empty_like(x)
        qkv = torch.empty(tokens, qkv_width, dtype=dtype)
        qk = torch.empty(tokens, rotated * head_dim, dtype=dtype)
        attended = torch.empty(tokens, heads * head_dim, dtype=dtype)
        act = torch.empty(tokens, inter, dtype=dtype)
        x_at, residual_at, normed_at = x.data_ptr(), residual.data_ptr(), normed.data_ptr()
        qkv_at, qk_at, attended_at, act_at = (t.data_ptr() for t in (qkv, qk, attended, act))
        element = x.element_size()
        k_at, v_at = qk_at + heads * head_dim * element, qkv_at + rotated * head_dim * element
        linear, ops, eps = self.gemm.linear_into, self.ops, self.eps
        threads = torch.get_num_threads()
        none, add, swiglu = OPS["none"], OPS["add"], OPS["swiglu"]
        for index, w in enumerate(self.layers):
            ops.rms_norm_into(x_at, hidden, tokens, w.input_norm, eps, normed_at)
            linear(
                normed_at, hidden, tokens, w.qkv.packed_weight, qkv_width, w.qkv.bias, none,
                0, 0, qkv_at, qkv_width, threads,
            )  # fmt: skip
            ops.rope_into(qkv_at, qkv_width, tokens, rotated, cos, sin, qk_at)
            step.store(index, k_at, rotated * head_dim, v_at, qkv_width)
            step.attend(index, qk_at, rotated * head_dim, attended_at, heads * head_dim)
            linear(
                attended_at, heads * head_dim, tokens, w.o.packed_weight, hidden, w.o.bias, add,
                x_at, hidden, residual_at, hidden, threads,
            )  # fmt: skip
            ops.rms_norm_into(residual_at, hidden, tokens, w.post_attn_norm, eps, normed_at)
            linear(
                normed_at, hidden, tokens, w.gate_up.packed_weight, 2 * inter, w.gate_up.bias,
                swiglu, 0, 0, act_at, inter, threads,
            )  # fmt: skip
            linear(
                act_at, inter, tokens, w.down.packed_weight, hidden, w.down.bias, add,
                residual_at, hidden, x_at, hidden, threads,
            )  # fmt: skip
        return x


def _layer_weights(layer: DecoderLayer) -> _LayerWeights | None:
    """A layer's weights, when its linears are packed (the MLP as one SwiGLU GEMM) and its
    norm weights dense; else None."""
    attn, mlp = layer.attn, layer.mlp
    qkv, o = attn.qkv_proj, attn.o_proj
    if not (isinstance(qkv, PackedLinear) and isinstance(o, PackedLinear)):
        return None
    if not isinstance(mlp, PackedMLP) or mlp.gate_up is None:
        return None
    norms = (layer.input_norm.weight.detach(), layer.post_attn_norm.weight.detach())
    if not all(norm.is_contiguous() for norm in norms):
        return None
    return _LayerWeights(norms[0], norms[1], qkv, o, mlp.gate_up, mlp.down)
