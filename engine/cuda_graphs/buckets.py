"""Which batch sizes get a captured decode graph, and how a decode step is padded to one.

A CUDA graph replays fixed kernels on fixed buffers, so one is captured per *bucket* of
batch sizes and a decode step of ``n`` sequences runs the smallest bucket ``>= n``, its
``bucket - n`` extra rows padded with values that cannot disturb the real ones::

    real rows  0 .. n-1      their token, position, context, block table
    pad rows   n .. bucket-1 token 0, position 0, context of 1 token,
                             block table (scratch, scratch, ...)

A row's slot follows from its position and table (``attention/base.py``): a pad row's is
``scratch * block_size``, offset 0 of the scratch block.

The scratch block is one block past the blocks the KV cache manager hands out: a pad row
writes its K/V there and attends to that one token, so its (finite, unused) output never
reaches a real sequence's KV or logits. Pure: plain lists in, plain lists out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Small batches are where graphs pay (launch overhead dominates), so they get exact buckets;
# above that a step of 8 wastes at most 7 padded rows while keeping the number of captures
# (each costs capture time and graph memory) to max / 8.
_SMALL_BUCKETS = (1, 2, 4)
_BUCKET_STEP = 8
MAX_GRAPH_BATCH = 512


def graph_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets for a scheduler that runs up to ``max_num_seqs`` sequences: 1, 2, 4, then
    multiples of 8 up to the first one that holds ``max_num_seqs`` (at most 512; bigger
    decode steps run eagerly)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    stepped = range(_BUCKET_STEP, MAX_GRAPH_BATCH + 1, _BUCKET_STEP)
    sizes = (*_SMALL_BUCKETS, *stepped)
    top = bucket_for(min(max_num_seqs, MAX_GRAPH_BATCH), sizes)
    assert top is not None, f"no bucket holds {MAX_GRAPH_BATCH} rows"
    return tuple(s for s in sizes if s <= top)


def bucket_for(batch_size: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``batch_size`` rows; None when none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass(slots=True, frozen=True)
class DecodeBatch:
    """One token per sequence: what a decode step feeds the model, row by row."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]  # the new token's position = context length - 1
    block_tables: tuple[tuple[int, ...], ...]  # each padded to the same width

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def context_lens(self) -> tuple[int, ...]:
        return tuple(p + 1 for p in self.positions)


def decode_batch(
    token_ids: list[int],
    positions: list[int],
    block_tables: list[tuple[int, ...]],
    block_size: int,
    table_width: int,
    scratch_block: int,
) -> DecodeBatch:
    """The rows of a decode step, block tables padded with the scratch block to
    ``table_width`` (a captured graph reads a fixed-width table)."""
    tables = []
    for position, table in zip(positions, block_tables, strict=True):
        used = table[: position // block_size + 1]
        if len(used) <= position // block_size or len(used) > table_width:
            raise ValueError(
                f"a block table of {len(table)} blocks cannot hold position {position} "
                f"within {table_width} blocks (block_size {block_size})"
            )
        tables.append(used + (scratch_block,) * (table_width - len(used)))
    return DecodeBatch(tuple(token_ids), tuple(positions), tuple(tables))


def pad_decode_batch(batch: DecodeBatch, bucket: int, scratch_block: int) -> DecodeBatch:
    """``batch`` grown to ``bucket`` rows with harmless pad rows (see the module docstring)."""
    pad = bucket - len(batch)
    if pad < 0:
        raise ValueError(f"a batch of {len(batch)} rows does not fit a bucket of {bucket}")
    width = len(batch.block_tables[0]) if batch.block_tables else 1
    return DecodeBatch(
        token_ids=batch.token_ids + (0,) * pad,
        positions=batch.positions + (0,) * pad,
        block_tables=batch.block_tables + ((scratch_block,) * width,) * pad,
    )
