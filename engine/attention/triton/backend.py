"""The ``cuda-triton`` attention backend: the Triton kernels of this package behind
:class:`AttentionBackend` (store, then prefill chunks and decode tokens in one launch each).

It reads pools of the queries' dtype (fp32, bf16, fp16) and int8 pools (``kv_format.py``:
the kernels dequantize rows as they read them; the store quantizes with the torch code the
CPU backends share, ``write_kv``). Token trees (speculative verification) of up to 64 rows
are masked by ancestry inside the prefill kernel; a pool of another dtype is refused with
a ValueError.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StepLayout,
    step_metadata,
    write_kv,
)
from pdserve.engine.attention.triton.config import TritonTiles
from pdserve.engine.attention.triton.decode import attend_decodes
from pdserve.engine.attention.triton.plan import TritonStepPlan, plan_step
from pdserve.engine.attention.triton.prefill import attend_prefills
from pdserve.engine.attention.triton.store import store_kv


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels (see the package docstring)."""

    name = "cuda-triton"

    def __init__(self, tiles: TritonTiles) -> None:
        self.tiles = tiles

    def build_metadata(
        self, layout: StepLayout, block_size: int, num_layers: int, device: torch.device
    ) -> AttentionMetadata:
        plan = plan_step(layout, device, self.tiles)
        return step_metadata(layout, block_size, num_layers, device, self, plan)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        plan = attn.backend_data
        assert isinstance(plan, TritonStepPlan), f"metadata built by {attn.backend.name}"
        _check_pool(q, kv_cache)
        if kv_cache.dtype == torch.int8:
            write_kv(kv_cache, layer_idx, attn.write_rows, k, v)  # quantizes (kv_format.py)
        else:
            store_kv(kv_cache, layer_idx, attn.slot_mapping, k, v)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
        if plan.num_prefills:
            attend_prefills(q, kv_cache, layer_idx, plan, out, self.tiles)
        if plan.num_decodes:
            attend_decodes(q, kv_cache, layer_idx, plan, out, self.tiles)
        return out


def _check_pool(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """ValueError for a pool the kernels do not read; assert on broken shapes."""
    if kv_cache.dtype not in (q.dtype, torch.int8):
        raise ValueError(
            f"attention backend 'cuda-triton' reads a pool of the queries' dtype or of int8 "
            f"rows, got a {kv_cache.dtype} pool for {q.dtype} queries"
        )
    num_heads, kv_heads = q.shape[1], kv_cache.shape[4]
    assert num_heads % kv_heads == 0, f"{num_heads} query heads over {kv_heads} kv heads"
    assert q.stride(2) == 1, "query rows must be dense"
