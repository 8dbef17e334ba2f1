"""The packed-GEMM micro-benchmark runs and prints one row per row count."""

from __future__ import annotations

import pytest

from bench import packed_gemm as bench
from bench.baselines_hf import TORCH_DTYPES
from engine.model.packed_gemm import gemm_for


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_prints_onednn_and_our_times_side_by_side(
    dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if gemm_for(TORCH_DTYPES[dtype]) is None:
        pytest.skip(
            f"no {dtype} packed GEMM here (no C compiler, or bf16 without AMX or AVX-512 BF16)"
        )
    bench.main(["--dtype", dtype, "--rows", "1,9", "--layers", "1", "--repeats", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert [r[0] for r in rows] == ["1", "9"]
    assert all(float(v) > 0 for r in rows for v in r[1:5]) and all(r[5].endswith("x") for r in rows)
