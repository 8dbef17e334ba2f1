"""The K/V store: each new token's K and V rows into its pool slot, in one launch.

A token's slot (``slot_mapping``, ``base.py``) names block ``slot // block_size`` and offset
``slot % block_size``; its rows in layer ``l`` are::

    pool[slot // block_size, l, 0, slot % block_size, :, :]   <- k[t]   [KVH, D]
    pool[slot // block_size, l, 1, slot % block_size, :, :]   <- v[t]

One program per token copies its ``KVH * D`` values of K and of V (K and V may be strided
views of the fused QKV projection: only the last dimension must be dense).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    pool_ptr,
    slot_ptr,
    layer_idx,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    pool_block_stride,
    pool_layer_stride,
    pool_kv_stride,
    pool_slot_stride,
    pool_head_stride,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_ELEMS: tl.constexpr,  # next power of two >= KV_HEADS * HEAD_DIM
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    elem = tl.arange(0, BLOCK_ELEMS)
    head = elem // HEAD_DIM
    dim = elem % HEAD_DIM
    ok = elem < KV_HEADS * HEAD_DIM
    k = tl.load(k_ptr + token * k_token_stride + head * k_head_stride + dim, mask=ok)
    v = tl.load(v_ptr + token * v_token_stride + head * v_head_stride + dim, mask=ok)
    dst = (
        pool_ptr
        + (slot // BLOCK_SIZE) * pool_block_stride
        + layer_idx * pool_layer_stride
        + (slot % BLOCK_SIZE) * pool_slot_stride
        + head * pool_head_stride
        + dim
    )
    tl.store(dst, k, mask=ok)
    tl.store(dst + pool_kv_stride, v, mask=ok)


def store_kv(
    kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D]
    layer_idx: int,
    slot_mapping: torch.Tensor,  # [T] int64
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
) -> None:
    """Write ``k``/``v`` of the step's ``T`` tokens into their slots of layer ``layer_idx``."""
    num_tokens, kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1, "K/V rows must be dense"
    assert kv_cache.is_contiguous(), "the KV pool must be contiguous"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        layer_idx,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *kv_cache.stride()[:5],
        BLOCK_SIZE=kv_cache.shape[3],
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_ELEMS=triton.next_power_of_2(kv_heads * head_dim),
    )
