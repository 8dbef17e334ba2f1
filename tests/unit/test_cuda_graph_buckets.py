"""The decode-graph bucket policy and padding (engine/cuda_graphs/buckets.py): pure lists
(the attention metadata's slot function checks where pad rows write)."""

from __future__ import annotations

import pytest

from pdserve.engine.attention.base import StepLayout, slot_mapping
from pdserve.engine.cuda_graphs.buckets import (
    DecodeBatch,
    bucket_for,
    decode_batch,
    graph_capture_sizes,
    pad_decode_batch,
)


def test_capture_sizes_cover_the_running_set() -> None:
    assert graph_capture_sizes(1) == (1,)
    assert graph_capture_sizes(5) == (1, 2, 4, 8)
    assert graph_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_capture_sizes(65)[-1] == 72
    assert graph_capture_sizes(10_000)[-1] == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_capture_sizes(0)


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    sizes = graph_capture_sizes(32)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [
        1, 2, 4, 4, 8, 8, 16, 24, 32,
    ]  # fmt: skip
    assert bucket_for(33, sizes) is None


def test_decode_batch_tables() -> None:
    batch = decode_batch([11, 12], [5, 0], [(7, 2, 9), (3,)], 4, 3, scratch_block=99)
    assert batch.block_tables == ((7, 2, 99), (3, 99, 99))  # trimmed to the context, padded
    assert batch.context_lens == (6, 1)
    with pytest.raises(ValueError, match="cannot hold position"):
        decode_batch([1], [8], [(7, 2)], 4, 3, scratch_block=99)


def test_pad_rows_write_scratch_and_read_one_token() -> None:
    batch = decode_batch([11, 12, 13], [5, 0, 3], [(7, 2), (3,), (4,)], 4, 2, scratch_block=99)
    padded = pad_decode_batch(batch, 8, scratch_block=99)
    assert padded == DecodeBatch(
        token_ids=(11, 12, 13, 0, 0, 0, 0, 0),
        positions=(5, 0, 3, 0, 0, 0, 0, 0),
        block_tables=((7, 2), (3, 99), (4, 99), *((99, 99),) * 5),
    )
    assert padded.context_lens[3:] == (1,) * 5
    # Slots as the attention metadata derives them: pad rows write offset 0 of the scratch
    # block (99 * 4), real rows where their positions live (block 2 offset 1 = slot 9, ...).
    layout = StepLayout(tuple(range(9)), padded.positions, padded.context_lens, padded.block_tables)
    assert slot_mapping(layout, 4) == [9, 12, 19, *(396,) * 5]
    assert pad_decode_batch(batch, 3, 99) == batch
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_batch(batch, 2, 99)
