"""The decode kernels: one query token per sequence, split along the context (split-K).

A decode step has few query rows and long contexts: one program per (sequence, kv head)
would leave most of a GPU idle. So each context is cut into ``num_splits`` pieces of
``split_keys`` positions, grid ``(sequence, kv head, split)``; a program attends the
``GROUP`` query heads of its kv head over its piece and leaves a partial output and its
log-sum-exp (log2 units)::

    partial_out [B, H, S, D] fp32     partial_lse [B, H, S] fp32 (-inf: an empty piece)

The merge kernel, grid ``(sequence, query head)``, weighs each piece by
``exp2(lse_s - max lse)`` and divides by their sum. With one split the first kernel writes
the output itself and the merge is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.triton.config import TritonTiles
from pdserve.engine.attention.triton.plan import TritonStepPlan
from pdserve.engine.attention.triton.tiles import (
    MASK_NONE,
    attend_keys,
    attention_launch,
    dot_block,
)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    pool_ptr,
    tables_ptr,
    query_start_ptr,
    context_len_ptr,
    decode_chunks_ptr,
    num_splits,
    split_keys,
    layer_idx,  # from here to pool_head_stride: tiles.attention_launch's args
    scale_log2,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    table_stride,
    pool_block_stride,
    pool_layer_stride,
    pool_kv_stride,
    pool_slot_stride,
    pool_head_stride,
    NUM_HEADS: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial outputs for the merge
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,  # next power of two >= GROUP (at least 16: tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INT8_ROWS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    chunk = tl.load(decode_chunks_ptr + seq)
    token = tl.load(query_start_ptr + chunk).to(tl.int64)
    context = tl.load(context_len_ptr + chunk)
    key_begin = split * split_keys
    key_end = tl.minimum(key_begin + split_keys, context)

    g = tl.arange(0, BLOCK_GROUP)
    head = kv_head * GROUP + g
    dim = tl.arange(0, BLOCK_D)
    ok = (g < GROUP)[:, None] & (dim < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * q_token_stride + head[:, None] * q_head_stride + dim[None, :],
                mask=ok, other=0.0)  # fmt: skip

    acc = tl.zeros((BLOCK_GROUP, BLOCK_D), dtype=tl.float32)
    row_max = tl.full((BLOCK_GROUP,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_GROUP,), dtype=tl.float32)
    kv_base = pool_ptr + layer_idx * pool_layer_stride + kv_head * pool_head_stride
    acc, row_max, row_sum = attend_keys(
        acc, row_max, row_sum, q, kv_base, tables_ptr + chunk * table_stride, key_begin,
        key_end, g, g, 0, pool_block_stride, pool_kv_stride, pool_slot_stride, scale_log2,
        BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_KEYS, MASK_NONE, PRECISION, DOT_FP32, INT8_ROWS,
    )  # fmt: skip
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if not SPLIT:
        out_rows = out_ptr + token * out_token_stride + head * HEAD_DIM
        tl.store(out_rows[:, None] + dim[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        empty = row_sum == 0.0  # a piece past this sequence's context
        lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))
        piece = (seq * NUM_HEADS + head) * num_splits + split  # [BLOCK_GROUP]
        tl.store(partial_lse_ptr + piece, lse, mask=g < GROUP)
        tl.store(partial_out_ptr + piece[:, None] * HEAD_DIM + dim[None, :], out, mask=ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_ptr,
    decode_chunks_ptr,
    out_token_stride,
    num_splits,
    NUM_HEADS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # next power of two >= num_splits
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.load(decode_chunks_ptr + seq)
    token = tl.load(query_start_ptr + chunk).to(tl.int64)
    split = tl.arange(0, BLOCK_SPLITS)
    dim = tl.arange(0, BLOCK_D)
    first_piece = (seq * NUM_HEADS + head) * num_splits
    lse = tl.load(partial_lse_ptr + first_piece + split, mask=split < num_splits,
                  other=float("-inf"))  # fmt: skip
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [SPLITS]; the first piece is never empty
    ok = (split < num_splits)[:, None] & (dim < HEAD_DIM)[None, :]
    pieces = tl.load(partial_out_ptr + (first_piece + split)[:, None] * HEAD_DIM + dim[None, :],
                     mask=ok, other=0.0)  # fmt: skip
    out = tl.sum(pieces * weight[:, None], axis=0) / tl.sum(weight, axis=0)  # [BLOCK_D]
    out_row = out_ptr + token * out_token_stride + head * HEAD_DIM
    tl.store(out_row + dim, out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_DIM)


def attend_decodes(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row]
    layer_idx: int,
    plan: TritonStepPlan,
    out: torch.Tensor,  # [T, H * D]: the rows of one-token chunks are written
    tiles: TritonTiles,
) -> None:
    """Attention of every one-token chunk of the step (see the module docstring)."""
    num_seqs, (num_heads, head_dim) = plan.num_decodes, q.shape[1:]
    kv_heads = kv_cache.shape[4]
    splits = plan.decode_splits
    partial_out = partial_lse = out  # unwritten with one split
    if splits.num_splits > 1:
        pieces = num_seqs * num_heads * splits.num_splits
        partial_out = torch.empty(pieces, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(pieces, dtype=torch.float32, device=q.device)
    launch = attention_launch(q, kv_cache, layer_idx, out, plan.block_tables, tiles)
    _decode_split_kernel[(num_seqs, kv_heads, splits.num_splits)](
        q,
        out,
        partial_out,
        partial_lse,
        kv_cache,
        plan.block_tables,
        plan.query_start,
        plan.context_lens,
        plan.decode_chunks,
        splits.num_splits,
        splits.split_keys,
        *launch.args,
        NUM_HEADS=num_heads,
        SPLIT=splits.num_splits > 1,
        GROUP=num_heads // kv_heads,
        BLOCK_GROUP=dot_block(num_heads // kv_heads),
        **launch.constants,
    )
    if splits.num_splits == 1:
        return
    _merge_splits_kernel[(num_seqs, num_heads)](
        out,
        partial_out,
        partial_lse,
        plan.query_start,
        plan.decode_chunks,
        out.stride(0),
        splits.num_splits,
        NUM_HEADS=num_heads,
        BLOCK_SPLITS=triton.next_power_of_2(splits.num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=dot_block(head_dim),
    )
