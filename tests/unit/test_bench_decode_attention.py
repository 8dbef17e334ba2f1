"""The decode-attention micro-benchmark: its step layout, and both paths side by side."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import decode_attention as bench
from pdserve.engine.attention.native import load_paged_decode


def test_step_covers_each_context_with_its_own_shuffled_blocks() -> None:
    layout, pool = bench.make_step(5, 40, torch.float32, seed=3)
    ids = [block for table in layout.block_tables for block in table]
    assert sorted(ids) == list(range(pool.shape[0])) and ids != sorted(ids)
    for table, n, start in zip(
        layout.block_tables, layout.context_lens, layout.start_positions, strict=True
    ):
        assert 20 <= n <= 60 and len(table) == -(-n // bench.BLOCK) and start == n - 1
    assert layout.query_start_loc == (0, 1, 2, 3, 4, 5)


def test_prints_both_paths_and_they_agree(capsys: pytest.CaptureFixture[str]) -> None:
    if load_paged_decode() is None:
        pytest.skip("no C compiler here: no decode kernel to measure")
    bench.main(["--seqs", "2,5", "--context", "40", "--repeats", "1", "--dtype", "fp32"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert [(r[0], r[1]) for r in rows] == [("2", "40"), ("5", "40")]
    assert all(float(v) > 0 for r in rows for v in r[2:7]) and all(r[7].endswith("x") for r in rows)
    assert all(float(r[8]) < 1e-4 for r in rows)  # the two paths compute the same attention
