"""The inner loop both attention kernels share: one tile of query rows against a range of
key positions read in place from the paged pool, with an online (streaming) softmax; and
what their launchers pass alike (:func:`attention_launch`).

Scores are kept in log2 units (``q . k * scale * log2(e)``) so each step takes ``exp2``;
``row_max`` and ``row_sum`` carry the softmax across key tiles and ``acc`` the unnormalised
output, all fp32. A row that has seen no allowed key yet has ``row_max = -inf``: the guard
below keeps its ``exp2(-inf - -inf)`` from becoming NaN.

Key ``p``'s K row is at ``kv_base + table[p // BLOCK_SIZE] * block_stride + (p % BLOCK_SIZE)
* slot_stride`` (``kv_base`` already holds the layer and kv head); its V row ``kv_stride``
further. Each key of a tile looks its block up on its own, so any block size works and a
tile may straddle blocks. Over an int8 pool a row is ``HEAD_DIM`` int8 values and then their
bf16 scale (``kv_format.py``): a tile's rows are dequantized to the queries' dtype as they
are read, as the torch paths dequantize what they gather.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.triton.config import TritonTiles

# Whether this module's kernels were decorated for Triton's interpreter (read at import, as
# ``@triton.jit`` read it).
INTERPRETED = bool(triton.knobs.runtime.interpret)

# How a tile masks keys against its rows.
MASK_NONE = tl.constexpr(0)  # decode: every key up to the end
MASK_CAUSAL = tl.constexpr(1)  # prefill: key position <= the row's position
MASK_TREE = tl.constexpr(2)  # token tree: the cached prefix, then the row's ancestors


@triton.jit
def attend_keys(
    acc,  # [ROWS, BLOCK_D] fp32
    row_max,  # [ROWS] fp32
    row_sum,  # [ROWS] fp32
    q,  # [ROWS, BLOCK_D] in the pool's dtype
    kv_base,  # pointer: the pool at (block 0, this layer, K, offset 0, this kv head)
    table_ptr,  # pointer: this sequence's block table
    key_begin,
    key_end,
    row_pos,  # [ROWS] position of each row's token (MASK_CAUSAL)
    row_ancestors,  # [ROWS] int64 ancestor bits (MASK_TREE)
    tree_start,  # the tree's first position (MASK_TREE)
    block_stride,
    kv_stride,
    slot_stride,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INT8_ROWS: tl.constexpr,  # the pool holds int8 rows and their scales (kv_format.py)
):
    values_dtype = q.dtype  # what K/V are read as (an int8 pool's rows dequantized to it)
    if DOT_FP32:
        q = q.to(tl.float32)
    dim = tl.arange(0, BLOCK_D)
    dim_ok = dim < HEAD_DIM
    for first_key in range(key_begin, key_end, BLOCK_KEYS):
        key = first_key + tl.arange(0, BLOCK_KEYS)
        key_ok = key < key_end
        block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = kv_base + block * block_stride + (key % BLOCK_SIZE) * slot_stride  # [KEYS]
        kv_ok = key_ok[None, :] & dim_ok[:, None]
        k = tl.load(rows[None, :] + dim[:, None], mask=kv_ok, other=0.0)  # [BLOCK_D, KEYS]
        if INT8_ROWS:
            k = (k.to(tl.float32) * row_scales(rows, key_ok, HEAD_DIM)[None, :]).to(values_dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [ROWS, KEYS]
        allowed = key_ok[None, :]
        if MASK == MASK_CAUSAL:
            allowed = allowed & (key[None, :] <= row_pos[:, None])
        if MASK == MASK_TREE:
            tree_row = (key - tree_start).to(tl.int64)
            in_tree = tree_row[None, :] >= 0
            ancestor = ((row_ancestors[:, None] >> tl.maximum(tree_row, 0)[None, :]) & 1) != 0
            allowed = allowed & (~in_tree | ancestor)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v_ok = key_ok[:, None] & dim_ok[None, :]
        v = tl.load(rows[:, None] + kv_stride + dim[None, :], mask=v_ok, other=0.0)  # [KEYS, D]
        if INT8_ROWS:
            v_scales = row_scales(rows + kv_stride, key_ok, HEAD_DIM)
            v = (v.to(tl.float32) * v_scales[:, None]).to(values_dtype)
        weights = probs.to(v.dtype)  # rounded to the K/V dtype, as FlashAttention does
        if DOT_FP32:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def row_scales(row_ptrs, ok, HEAD_DIM: tl.constexpr):
    """The bf16 scale after each int8 row's ``HEAD_DIM`` values, as fp32: its two bytes
    (little-endian) are the high half of the fp32's bits."""
    low = tl.load(row_ptrs + HEAD_DIM, mask=ok, other=0).to(tl.uint8, bitcast=True)
    high = tl.load(row_ptrs + HEAD_DIM + 1, mask=ok, other=0).to(tl.uint8, bitcast=True)
    bits = (high.to(tl.uint32) << 24) | (low.to(tl.uint32) << 16)
    return bits.to(tl.float32, bitcast=True)


class AttentionLaunch(NamedTuple):
    """What the decode and prefill launchers pass alike (:func:`attention_launch`)."""

    # The run of runtime arguments both kernels end with: layer_idx, scale_log2,
    # q_token_stride, q_head_stride, out_token_stride, table_stride, then the pool's strides
    # of block, layer, K|V, slot and kv head.
    args: tuple[object, ...]
    # BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_KEYS, the dot options and num_warps.
    constants: dict[str, object]


def attention_launch(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row]
    layer_idx: int,
    out: torch.Tensor,  # [T, H * D]
    block_tables: torch.Tensor,  # [num_chunks, max_blocks]
    tiles: TritonTiles,
) -> AttentionLaunch:
    """The strides, scale and constants of one attention kernel launch over ``kv_cache``'s
    layer ``layer_idx`` (the kernels read the pool, the queries and the output in place)."""
    head_dim = q.shape[2]
    args = (
        layer_idx,
        softmax_scale_log2(head_dim),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        block_tables.stride(0),
        *kv_cache.stride()[:5],
    )
    constants = {
        "BLOCK_SIZE": kv_cache.shape[3],
        "HEAD_DIM": head_dim,
        "BLOCK_D": dot_block(head_dim),
        "BLOCK_KEYS": tiles.key_tile(q.dtype),
        **dot_options(q.dtype, kv_cache),
        "num_warps": tiles.num_warps,
    }
    return AttentionLaunch(args, constants)


def dot_block(n: int) -> int:
    """A tile side for ``n`` rows or values: the next power of two, at least 16 (``tl.dot``'s
    minimum)."""
    return max(16, triton.next_power_of_2(n))


def dot_options(dtype: torch.dtype, pool: torch.Tensor) -> dict[str, object]:
    """The ``PRECISION``, ``DOT_FP32`` and ``INT8_ROWS`` constants of :func:`attend_keys` for
    queries of ``dtype`` over ``pool``.

    fp32 products run in full fp32 (Triton's default rounds fp32 inputs to tf32). Under the
    interpreter, bf16 operands are widened to fp32 first (exact): its ``tl.dot`` multiplies
    the raw bits of bf16 values, which it stores as uint16 (Triton 3.9). On a GPU they stay
    bf16, so the interpreter tests do not cover that one operand type.
    """
    dot_fp32 = INTERPRETED and dtype == torch.bfloat16
    return {
        "PRECISION": "ieee" if dtype == torch.float32 or dot_fp32 else None,
        "DOT_FP32": dot_fp32,
        "INT8_ROWS": pool.dtype == torch.int8,
    }


def softmax_scale_log2(head_dim: int) -> float:
    """``1 / sqrt(head_dim)`` (the models' attention scale) times ``log2(e)``, for ``exp2``."""
    return head_dim**-0.5 * 1.4426950408889634
