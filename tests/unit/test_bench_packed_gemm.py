"""The packed-GEMM micro-benchmark runs and prints one row per row count."""

from __future__ import annotations

import pytest

from pdserve.bench import packed_gemm as bench
from pdserve.bench.baselines_hf import TORCH_DTYPES
from pdserve.engine.model.packed_gemm import gemm_for


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("pages", [[], ["--huge-pages"]])
def test_prints_onednn_and_our_times_side_by_side(
    dtype: str, pages: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    if gemm_for(TORCH_DTYPES[dtype]) is None:
        pytest.skip(
            f"no {dtype} packed GEMM here (no C compiler, or bf16 without AMX or AVX-512 BF16)"
        )
    bench.main(["--dtype", dtype, "--rows", "1,9", "--layers", "1", "--repeats", "1", *pages])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].endswith("huge pages" if pages else "4 KiB pages")
    rows = [line.split() for line in lines[1:-1]]
    assert [r[0] for r in rows] == ["1", "9"]
    assert all(float(v) > 0 for r in rows for v in r[1:5]) and all(r[5].endswith("x") for r in rows)
