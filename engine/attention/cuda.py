"""Paged attention on CUDA with ``flash_attn`` (FlashAttention-2).

NOT RUN ON THIS MACHINE: the development machine has no GPU and no ``flash_attn`` wheel, so
this backend is written against flash-attn's documented API and has never executed. Treat it
as a starting point to validate on a GPU with ``tests/unit/test_attention.py``.

``flash_attn`` is imported inside :func:`make_flash_attn_backend`, so importing this module
never pulls in CUDA code. All chunks of a step run in one ``flash_attn_varlen_func`` call with
``causal=True``; flash-attn (>= 2.1) aligns the causal mask bottom-right, which is exactly
"every cached position plus the causal part of the chunk" for chunks starting at
``start_pos > 0``. It reads the pool's per-layer K/V views ``[num_blocks, block_size,
kv_heads, head_dim]`` in place through a block table, which flash-attn's paged-KV path takes
only for block sizes that are multiples of 256; other block sizes are refused (the
``cuda-triton`` backend reads any block size in place).

Tree chunks (speculative verification) need a mask flash-attn cannot express: their rows
are recomputed after the varlen call with one masked SDPA each over the chunk's gathered
prefix (``attend_tree``, the CPU backend's function; a tree holds tens of rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StepLayout,
    step_metadata,
    tree_mask,
    write_kv,
)
from pdserve.engine.attention.cpu_prefill import attend_tree

_PAGED_KV_PAGE_MULTIPLE = 256


@dataclass(slots=True, frozen=True)
class _CudaStepData:
    cu_seqlens_q: torch.Tensor  # [num_chunks + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_chunks + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_chunks, max_blocks] int32
    trees: tuple[_TreeChunk, ...] = ()


@dataclass(slots=True, frozen=True)
class _TreeChunk:
    token_start: int
    token_end: int
    prefix_len: int
    prefix_block_rows: torch.Tensor  # [prefix blocks] layer-0 K block rows
    mask: torch.Tensor  # [n, n] bool


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen attention over the paged pool (see the module docstring)."""

    def __init__(self, varlen_func: Callable[..., torch.Tensor]) -> None:
        self._varlen = varlen_func
        self.name = "flash_attn"

    def build_metadata(
        self, layout: StepLayout, block_size: int, num_layers: int, device: torch.device
    ) -> AttentionMetadata:
        q_lens = [e - s for s, e in zip(layout.start_positions, layout.context_lens, strict=True)]
        data = _CudaStepData(
            cu_seqlens_q=_cumulative(q_lens, device),
            cu_seqlens_k=_cumulative(list(layout.context_lens), device),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(layout.context_lens, default=0),
            block_table=_padded_table(layout, device),
            trees=_tree_chunks(layout, block_size, num_layers, device),
        )
        return step_metadata(layout, block_size, num_layers, device, self, data)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        data = attn.backend_data
        assert isinstance(data, _CudaStepData), f"metadata built by {attn.backend.name}"
        if kv_cache.dtype == torch.int8:
            raise ValueError(
                "attention backend 'flash_attn' reads K/V in the model's dtype and has no "
                "int8 pool path; use kv_cache_dtype 'auto' on CUDA (int8 pools run on the cpu "
                "backends)"
            )
        block_size = kv_cache.shape[3]
        if not flash_attn_reads_blocks_of(block_size):
            raise ValueError(
                f"attention backend 'flash_attn' reads the KV pool in place only with block "
                f"sizes that are multiples of {_PAGED_KV_PAGE_MULTIPLE} (256, 512, ...), got "
                f"{block_size}; use such a block size, or attention backend 'cuda-triton'"
            )
        write_kv(kv_cache, layer_idx, attn.write_rows, k, v)
        keys, values = kv_cache[:, layer_idx, 0], kv_cache[:, layer_idx, 1]
        out = self._varlen(
            q,
            keys,
            values,
            cu_seqlens_q=data.cu_seqlens_q,
            cu_seqlens_k=data.cu_seqlens_k,
            max_seqlen_q=data.max_seqlen_q,
            max_seqlen_k=data.max_seqlen_k,
            causal=True,
            block_table=data.block_table,
        )
        out = out.reshape(q.shape[0], -1)  # [T, H * D]
        for tree in data.trees:
            rows = slice(tree.token_start, tree.token_end)
            prefix = _gather_prefix(kv_cache, layer_idx, tree) if tree.prefix_len else None
            out[rows] = attend_tree(q[rows], k[rows], v[rows], prefix, tree.mask)
        return out


def make_flash_attn_backend() -> FlashAttnBackend:
    """Import ``flash_attn`` now (not at package import) and wrap it in a backend."""
    try:
        import flash_attn
    except ImportError as exc:
        raise ValueError(
            "attention backend 'flash_attn' needs the flash-attn package and a CUDA GPU "
            f"({exc}); install it with `pip install flash-attn --no-build-isolation` or use "
            "--attention-backend cpu"
        ) from exc
    varlen: Any = flash_attn.flash_attn_varlen_func
    return FlashAttnBackend(varlen)


def flash_attn_reads_blocks_of(block_size: int) -> bool:
    """Whether flash-attn's paged-KV path takes blocks of ``block_size`` positions."""
    return block_size % _PAGED_KV_PAGE_MULTIPLE == 0


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _padded_table(layout: StepLayout, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in layout.block_tables), default=1)
    rows = [t + (0,) * (width - len(t)) for t in layout.block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _tree_chunks(
    layout: StepLayout, block_size: int, num_layers: int, device: torch.device
) -> tuple[_TreeChunk, ...]:
    trees = []
    for i, start in enumerate(layout.start_positions):
        parents = layout.tree_parents(i)
        if not parents:
            continue
        blocks = layout.block_tables[i][: -(-start // block_size)]
        trees.append(
            _TreeChunk(
                token_start=layout.query_start_loc[i],
                token_end=layout.query_start_loc[i + 1],
                prefix_len=start,
                prefix_block_rows=torch.tensor(
                    [b * num_layers * 2 for b in blocks], dtype=torch.int64, device=device
                ),
                mask=tree_mask(parents, device),
            )
        )
    return tuple(trees)


def _gather_prefix(
    kv_cache: torch.Tensor, layer_idx: int, tree: _TreeChunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree chunk's cached K and V, ``[KVH, prefix_len, D]`` each."""
    block_size, kv_heads, head_dim = kv_cache.shape[3:]
    gather_view = kv_cache.view(-1, block_size, kv_heads, head_dim)
    k_rows = tree.prefix_block_rows + 2 * layer_idx
    keys = gather_view.index_select(0, k_rows).view(-1, kv_heads, head_dim)[: tree.prefix_len]
    values = gather_view.index_select(0, k_rows + 1).view(-1, kv_heads, head_dim)
    return keys.transpose(0, 1), values[: tree.prefix_len].transpose(0, 1)
