"""The prefill kernel: every multi-token chunk of a step in one launch.

Grid ``(prefill chunk, query tile, kv head)``. A program takes ``TILE_TOKENS`` consecutive
tokens of one chunk and the ``GROUP`` query heads that share one kv head, packed as the rows
of one tile, so each K/V tile is read once for the whole group::

    tile row r  ->  token  first + r // GROUP,  query head  kv_head * GROUP + r % GROUP

It walks the keys ``0 .. start + last token of the tile`` (the cached prefix and the chunk
itself, all read from the pool: the store ran first) with the causal rule ``key <= the
row's position``; a token tree walks the whole chunk and masks by ancestry instead. Tiles
past a shorter chunk's end return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.triton.config import TritonTiles
from pdserve.engine.attention.triton.plan import TritonStepPlan
from pdserve.engine.attention.triton.tiles import (
    MASK_CAUSAL,
    MASK_TREE,
    attend_keys,
    attention_launch,
    dot_block,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    pool_ptr,
    tables_ptr,
    query_start_ptr,
    start_pos_ptr,
    context_len_ptr,
    is_tree_ptr,
    ancestors_ptr,
    prefill_chunks_ptr,
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
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,  # next power of two >= TILE_TOKENS * GROUP
    BLOCK_KEYS: tl.constexpr,
    HAS_TREES: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INT8_ROWS: tl.constexpr,
):
    chunk = tl.load(prefill_chunks_ptr + tl.program_id(0))
    first = tl.program_id(1) * TILE_TOKENS  # chunk row of the tile's first token
    kv_head = tl.program_id(2)
    token0 = tl.load(query_start_ptr + chunk)
    num_tokens = tl.load(query_start_ptr + chunk + 1) - token0
    if first >= num_tokens:
        return
    start = tl.load(start_pos_ptr + chunk)
    context = tl.load(context_len_ptr + chunk)

    r = tl.arange(0, BLOCK_ROWS)
    row = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TILE_TOKENS * GROUP) & (row < num_tokens)
    dim = tl.arange(0, BLOCK_D)
    q_ok = row_ok[:, None] & (dim < HEAD_DIM)[None, :]
    token = (token0 + row).to(tl.int64)
    q_rows = q_ptr + token * q_token_stride + head * q_head_stride  # [ROWS]
    q = tl.load(q_rows[:, None] + dim[None, :], mask=q_ok, other=0.0)

    acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=tl.float32)
    row_max = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    kv_base = pool_ptr + layer_idx * pool_layer_stride + kv_head * pool_head_stride
    table = tables_ptr + chunk * table_stride
    last_token = tl.minimum(first + TILE_TOKENS, num_tokens) - 1
    tree = False
    if HAS_TREES:
        tree = tl.load(is_tree_ptr + chunk) != 0
    if tree:
        ancestors = tl.load(ancestors_ptr + token, mask=row_ok, other=0)
        acc, row_max, row_sum = attend_keys(
            acc, row_max, row_sum, q, kv_base, table, 0, context, start + row, ancestors,
            start, pool_block_stride, pool_kv_stride, pool_slot_stride, scale_log2,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_KEYS, MASK_TREE, PRECISION, DOT_FP32, INT8_ROWS,
        )  # fmt: skip
    else:
        acc, row_max, row_sum = attend_keys(
            acc, row_max, row_sum, q, kv_base, table, 0, start + last_token + 1, start + row,
            row, start, pool_block_stride, pool_kv_stride, pool_slot_stride, scale_log2,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_KEYS, MASK_CAUSAL, PRECISION, DOT_FP32, INT8_ROWS,
        )  # fmt: skip

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    out_rows = out_ptr + token * out_token_stride + head * HEAD_DIM
    tl.store(out_rows[:, None] + dim[None, :], out.to(out_ptr.dtype.element_ty), mask=q_ok)


def attend_prefills(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row]
    layer_idx: int,
    plan: TritonStepPlan,
    out: torch.Tensor,  # [T, H * D]: the rows of prefill chunks are written
    tiles: TritonTiles,
) -> None:
    """Attention of every multi-token chunk of the step (see the module docstring)."""
    num_heads, kv_heads = q.shape[1], kv_cache.shape[4]
    group = num_heads // kv_heads
    tile_tokens = max(1, tiles.query_rows // group)
    grid = (plan.num_prefills, triton.cdiv(plan.max_prefill_tokens, tile_tokens), kv_heads)
    ancestors = plan.tree_ancestors
    launch = attention_launch(q, kv_cache, layer_idx, out, plan.block_tables, tiles)
    _prefill_kernel[grid](
        q,
        out,
        kv_cache,
        plan.block_tables,
        plan.query_start,
        plan.start_positions,
        plan.context_lens,
        plan.chunk_is_tree,
        plan.query_start if ancestors is None else ancestors,  # unread without trees
        plan.prefill_chunks,
        *launch.args,
        GROUP=group,
        TILE_TOKENS=tile_tokens,
        BLOCK_ROWS=dot_block(tile_tokens * group),
        HAS_TREES=ancestors is not None,
        **launch.constants,
    )
