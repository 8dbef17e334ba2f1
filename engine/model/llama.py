"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch and a paged KV pool.

One forward runs every token of a step at once: prefill chunks and decode tokens of many
sequences back to back. Linear layers see all ``T`` tokens as one matrix; only attention
looks at sequence boundaries, through :class:`AttentionMetadata`.

Parameter names (what the loader produces)::

    embed_tokens.weight                         [vocab, hidden]
    layers.{i}.input_norm.weight                [hidden]
    layers.{i}.attn.qkv_proj.weight (.bias)     [(H + 2 * KVH) * head_dim, hidden]   q | k | v
    layers.{i}.attn.o_proj.weight (.bias)       [hidden, H * head_dim]
    layers.{i}.post_attn_norm.weight            [hidden]
    layers.{i}.mlp.gate_up_proj.weight (.bias)  [2 * intermediate, hidden]           gate | up
    layers.{i}.mlp.down_proj.weight (.bias)     [hidden, intermediate]
    norm.weight                                 [hidden]
    lm_head.weight                              [vocab, hidden]   (absent when tied)
    rope_freq_factors                           [head_dim / 2]    (optional, Llama 3 GGUF)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.host_memory import release_free_heap
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.fused_ops import fused_ops
from pdserve.engine.model.native_step import NativeDecodeLayers
from pdserve.engine.model.packed_linear import (
    PackedLinear,
    PackedMLP,
    gather_on_huge_pages,
    project_add,
)
from pdserve.engine.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops()
        fused = None if ops is None else ops.rms_norm(x, self.weight, self.eps)
        return fused if fused is not None else self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same norm in torch ops, for what the fused op does not take."""
        if x.dtype == torch.float32:  # one fused op (the two-step form costs a second pass)
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # The reference normalises in fp32, rounds to the model dtype, then scales in it.
        # rms_norm on bf16 input computes in fp32 and rounds once: the same values (checked
        # bit for bit), without the two conversion passes of x.float() and .to().
        normed = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * normed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim / 2]
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        residual: torch.Tensor,  # [T, hidden]
    ) -> torch.Tensor:
        """``residual + attention(x)``."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KVH) * D]
        rotated_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : rotated_heads * self.head_dim].view(num_tokens, rotated_heads, -1)
        qk = apply_rope(qk, cos, sin)  # [T, H + KVH, D]: q and k rotated in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, rotated_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, -1)
        out = attn.backend.forward(self.layer_idx, q, k, v, kv_cache, attn)  # [T, H * D]
        return project_add(self.o_proj, out, residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``; ``x``, ``residual``: [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | PackedMLP = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = self.attn(self.input_norm(x), cos, sin, attn, kv_cache, residual=x)
        return self.mlp(self.post_attn_norm(x), residual=x)

    def pack_linears(self) -> None:
        """Swap this layer's linears for oneDNN-packed ones (see ``LlamaModel.pack_linears``)."""
        attn = self.attn
        for name in ("qkv_proj", "o_proj"):
            proj = getattr(attn, name)
            if isinstance(proj, nn.Linear):
                setattr(attn, name, PackedLinear(proj.weight, proj.bias))
        if isinstance(self.mlp, MLP):
            gate_up = self.mlp.gate_up_proj
            self.mlp = PackedMLP(gate_up.weight, gate_up.bias, self.mlp.down_proj)


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Build with :meth:`from_state_dict` (no random init)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = None  # nn.Linear, or PackedLinear once packed
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary
        self.native_layers: NativeDecodeLayers | None = None  # set by pack_linears

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state_dict: dict[str, torch.Tensor]
    ) -> LlamaModel:
        """Adopt the loader's tensors as parameters (no copy, no random initialisation)."""
        weights = dict(state_dict)
        freq_factors = weights.pop("rope_freq_factors", None)
        dtype = weights["embed_tokens.weight"].dtype
        device = weights["embed_tokens.weight"].device
        inv_freq = rope_inv_freq(config, freq_factors).to(device)
        rotary = RotaryEmbedding(inv_freq, config.max_context_tokens, dtype)
        with torch.device("meta"):
            model = cls(config, rotary)
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval()

    def pack_linears(self) -> None:
        """Serve on CPU with oneDNN-packed weights (``engine/model/packed_linear.py``).

        In place and idempotent (engines may share one model). A tied LM head gets a packed
        copy of the embedding matrix (the lookup still needs the plain one): ``vocab *
        hidden`` more elements, 113 MB for SmolLM2 in fp32, for 8-11 ms less per decode step
        of 4..64 sequences (fp32, one thread).
        """
        if isinstance(self.lm_head, PackedLinear):
            return  # packed already
        for layer in self.decoder_layers():
            layer.pack_linears()
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
        elif isinstance(self.lm_head, nn.Linear):
            self.lm_head = PackedLinear(self.lm_head.weight, None)
        gather_on_huge_pages(self)
        # Loaded weights may be views of one memory-mapped file: while any of them (the
        # embedding, the norms) lives, the whole mapping stays, and every page packing read
        # stays resident (+425 MB RSS for SmolLM2 in fp32). Private copies release it.
        for param in self.parameters():
            param.data = param.data.clone()
        release_free_heap()  # the packed weights' first copies, freed to a heap that keeps
        self.native_layers = NativeDecodeLayers.for_layers(self.config, self.decoder_layers())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row] (attention/base.py)
        *,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch; returns final-normed hidden states ``[T, hidden]``.

        ``max_position``: the largest of ``positions``, when the caller knows it on the host.
        Then it is checked against the context here, instead of by reading ``positions``
        back: on a GPU that read is a sync per step, and a CUDA graph capture forbids it."""
        cos, sin = self._rope(positions, max_position)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.native_layers is not None:
            step = attn.backend.bind_native_decode(attn, kv_cache, x.dtype, self.config.num_heads)
            if step is not None:  # the same kernels, called without the modules
                return self.norm(self.native_layers.run(x, cos, sin, step))
        for layer in self.layers:
            x = layer(x, cos, sin, attn, kv_cache)
        return self.norm(x)

    def _rope(
        self, positions: torch.Tensor, max_position: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim / 2]`` of each position."""
        rotary = self.rotary
        if max_position is None:
            return rotary.lookup(positions)
        if max_position >= rotary.cos.shape[0]:
            raise ValueError(
                f"position {max_position} is beyond the model's context of "
                f"{rotary.cos.shape[0]} tokens"
            )
        return rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)

    def decoder_layers(self) -> list[DecoderLayer]:
        """``self.layers``, typed."""
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        assert len(layers) == len(self.layers), "unexpected layer types"
        return layers

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, hidden]`` -> fp32 logits ``[N, vocab]``."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
