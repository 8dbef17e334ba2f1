"""The prefill-attention micro-benchmark runs and prints one row per (prefix, length)."""

from __future__ import annotations

import pytest

from pdserve.bench import prefill_attention as bench
from pdserve.engine.attention.paged_prefill import load_paged_prefill


def test_prints_torch_and_our_times_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    if load_paged_prefill() is None:
        pytest.skip("no C compiler here: no prefill kernel to measure")
    bench.main(["--tokens", "5,40", "--prefix", "0,20"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert [(r[0], r[1]) for r in rows] == [("5", "0"), ("40", "0"), ("5", "20"), ("40", "20")]
    assert all(float(v) > 0 for r in rows for v in r[2:6]) and all(r[6].endswith("x") for r in rows)
