"""The fused RMSNorm and RoPE (engine/csrc/fused_ops.c) against the torch code they replace,
on the layouts the model hands them, and their fallback when they cannot be built."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

import pdserve.engine.native_build as native_build
from pdserve.engine.model.fused_ops import FusedOps, fused_ops
from pdserve.engine.model.llama import RMSNorm
from pdserve.engine.model.rope import apply_rope_torch
from tests.fused_op_inputs import rms_norm_inputs, rope_inputs

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    loaded = fused_ops()
    if loaded is None:
        pytest.skip("no C compiler here: the model keeps its torch path")
    return loaded


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 tokens: split over threads
def test_rope_is_bit_identical_to_torch_on_rows_of_the_fused_qkv(
    ops: FusedOps, dtype: torch.dtype, tokens: int
) -> None:
    qk, cos, sin = rope_inputs(tokens, dtype, HEADS, KV_HEADS, HEAD_DIM)
    got = ops.rope(qk, cos, sin)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, apply_rope_torch(qk, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_matches_torch(ops: FusedOps, dtype: torch.dtype, tokens: int) -> None:
    norm, x = rms_norm_inputs(tokens, HIDDEN, dtype)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    assert got is not None
    expected = norm.torch_forward(x)
    if dtype == torch.float32:  # squares summed in another order: the last bit may differ
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the sum rarely moves a bf16 rounding; then by one bf16 step at most
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0.0)


def test_what_the_c_side_does_not_take_returns_none_and_the_model_falls_back(
    ops: FusedOps,
) -> None:
    x = torch.randn(4, HIDDEN, dtype=torch.float64)
    norm = RMSNorm(HIDDEN, eps=1e-5).to(torch.float64)
    assert ops.rms_norm(x, norm.weight, norm.eps) is None  # a dtype it has no code for
    assert ops.rms_norm(x.float().t(), norm.weight.float()[:4], 1e-5) is None  # strided cols
    torch.testing.assert_close(norm(x), norm.torch_forward(x))
    q = torch.randn(2, HEADS, HEAD_DIM)
    cos = torch.randn(2, 1, HEAD_DIM // 2)
    assert ops.rope(q.transpose(0, 1), cos, cos) is None  # heads not dense


def test_without_a_compiler_the_loader_reports_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    assert fused_ops.__wrapped__() is None
    assert "no C compiler" in caplog.text and "torch path" in caplog.text


def test_a_shared_header_is_part_of_the_build_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Editing a header a source includes, directly or through another header, must build a
    new library, not load the old one."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: nothing is built")
    monkeypatch.setattr(native_build, "cache_dir", lambda: tmp_path)
    (tmp_path / "one.h").write_text("static int one(void) { return 1; }\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "two.h").write_text('#include "../one.h"\n#define TWO (2 * one())\n')
    source = tmp_path / "lib.c"
    source.write_text('#include "sub/two.h"\nint value(void) { return TWO; }\n')
    cflags = ("-O1", "-fPIC", "-shared")
    first = native_build.built_library(source, cflags)
    assert ctypes.CDLL(str(first)).value() == 2
    (tmp_path / "one.h").write_text("static int one(void) { return 2; }\n")
    second = native_build.built_library(source, cflags)
    assert first != second
    assert ctypes.CDLL(str(second)).value() == 4
