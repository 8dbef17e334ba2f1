"""The per-step index tensors of the Triton kernels, built once per step on the host.

Every int32 index goes to the device in ONE copy (a packed tensor, sliced into views)::

    block_tables    [C, W]    each chunk's blocks, padded with 0 to the widest (W)
    query_start     [C + 1]   first flat token of each chunk (and the total)
    start_positions [C]       cached positions before each chunk
    context_lens    [C]       start + tokens: the keys each chunk's last token sees
    chunk_is_tree   [C]       1 for a token tree (rows attend by ancestry), else 0
    prefill_chunks  [P]       the chunks of several tokens (prefill kernel)
    decode_chunks   [B]       the chunks of one token (decode kernel)

A key position ``p`` of chunk ``c`` lives in block ``block_tables[c, p // block_size]`` at
offset ``p % block_size`` (``base.py``); the padding is never read (kernels stop at
``context_lens[c]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import StepLayout, tree_ancestors
from pdserve.engine.attention.triton.config import TritonTiles

# A tree row's ancestors are bits of one int64.
MAX_TREE_ROWS = 64


@dataclass(slots=True, frozen=True)
class DecodeSplits:
    """How the decode kernel cuts each context: ``num_splits`` pieces of ``split_keys``
    positions (a multiple of the key tile); a sequence shorter than the longest leaves its
    last pieces empty, and the merge weighs those by zero."""

    num_splits: int
    split_keys: int


@dataclass(slots=True, frozen=True)
class TritonStepPlan:
    """Device index tensors of one step (see the module docstring)."""

    query_start: torch.Tensor
    start_positions: torch.Tensor
    context_lens: torch.Tensor
    chunk_is_tree: torch.Tensor
    prefill_chunks: torch.Tensor
    decode_chunks: torch.Tensor
    block_tables: torch.Tensor
    max_prefill_tokens: int
    decode_splits: DecodeSplits
    tree_ancestors: torch.Tensor | None  # [T] int64: per token of a tree chunk, else 0

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_chunks.shape[0])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_chunks.shape[0])


def decode_splits(
    max_context: int, key_tile: int, split_tokens: int, max_splits: int
) -> DecodeSplits:
    """About ``split_tokens`` keys per split, at most ``max_splits`` splits; one split when
    the longest context fits one."""
    num_splits = max(1, min(max_splits, -(-max_context // split_tokens)))
    per_split = -(-max_context // num_splits)
    split_keys = max(key_tile, -(-per_split // key_tile) * key_tile)
    return DecodeSplits(-(-max_context // split_keys) if max_context else 1, split_keys)


def plan_step(layout: StepLayout, device: torch.device, tiles: TritonTiles) -> TritonStepPlan:
    """The index tensors of ``layout``; ValueError for a token tree the kernel cannot mask."""
    num_chunks = len(layout.context_lens)
    lengths = [e - s for s, e in zip(layout.start_positions, layout.context_lens, strict=True)]
    prefills = [c for c in range(num_chunks) if lengths[c] > 1]
    decodes = [c for c in range(num_chunks) if lengths[c] == 1]
    width = max((len(t) for t in layout.block_tables), default=1)
    is_tree = [int(bool(layout.tree_parents(c))) for c in range(num_chunks)]
    packed = [
        *(b for t in layout.block_tables for b in (*t, *(0,) * (width - len(t)))),
        *layout.query_start_loc,
        *layout.start_positions,
        *layout.context_lens,
        *is_tree,
        *prefills,
        *decodes,
    ]
    ints = torch.tensor(packed, dtype=torch.int32, device=device)
    sizes = [num_chunks + 1, num_chunks, num_chunks, num_chunks, len(prefills), len(decodes)]
    tables, query_start, starts, lens, trees, prefill, decode = ints.split(
        [num_chunks * width, *sizes]
    )
    max_decode_context = max((layout.context_lens[c] for c in decodes), default=0)
    return TritonStepPlan(
        query_start=query_start,
        start_positions=starts,
        context_lens=lens,
        chunk_is_tree=trees,
        prefill_chunks=prefill,
        decode_chunks=decode,
        block_tables=tables.view(num_chunks, width),
        max_prefill_tokens=max((lengths[c] for c in prefills), default=0),
        decode_splits=decode_splits(
            max_decode_context, tiles.key_tokens, tiles.split_tokens, tiles.max_splits
        ),
        tree_ancestors=_tree_ancestors(layout, device) if any(is_tree) else None,
    )


def _tree_ancestors(layout: StepLayout, device: torch.device) -> torch.Tensor:
    """``[T]`` int64: bit ``j`` of a tree row's word is set when chunk row ``j`` is the row
    or one of its ancestors; 0 for the rows of other chunks."""
    bits = [0] * layout.num_tokens
    for chunk in range(len(layout.context_lens)):
        parents = layout.tree_parents(chunk)
        if not parents:
            continue
        if len(parents) > MAX_TREE_ROWS:
            raise ValueError(
                f"a token tree of {len(parents)} rows; attention backend 'cuda-triton' masks "
                f"trees of at most {MAX_TREE_ROWS} rows (lower max_tree_nodes)"
            )
        first = layout.query_start_loc[chunk]
        for row, word in enumerate(tree_ancestors(parents)):
            bits[first + row] = word - (1 << 64) if word >= 1 << 63 else word  # as int64
    return torch.tensor(bits, dtype=torch.int64, device=device)
