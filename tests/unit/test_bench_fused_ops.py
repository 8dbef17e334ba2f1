"""The fused-ops micro-benchmark runs and prints one row per op, dtype and token count."""

from __future__ import annotations

import pytest

from pdserve.bench import fused_ops as bench
from pdserve.engine.model.fused_ops import fused_ops


def test_prints_torch_and_fused_times_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    if fused_ops() is None:
        pytest.skip("no C compiler here: nothing fused to measure")
    bench.main(["--tokens", "1,3", "--repeats", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(
        (op, dtype, tokens)
        for op in ("rms_norm", "rope")
        for dtype in ("float32", "bfloat16")
        for tokens in ("1", "3")
    )
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and r[5].endswith("x") for r in rows)
