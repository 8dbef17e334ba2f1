"""The Triton RMSNorm and RoPE (engine/model/triton_ops.py, the CUDA branch of fused_ops.py)
under Triton's interpreter on CPU tensors, against the torch code they replace, on the
layouts the model hands them."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

from pdserve.engine.model.fused_ops import cuda_fused_ops, fused_ops
from pdserve.engine.model.rope import apply_rope_torch
from tests.fused_op_inputs import rms_norm_inputs, rope_inputs
from tests.triton_interpreter import MODES, interpreted_kernels, kernels_for

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 3, 1, 16, 48  # 48: not a power of two, the tile is masked
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# INTERPRETER_BF16: Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to
# nearest even, as torch does), so here bf16 results may sit a step or two from torch's;
# bit identity in bf16 is left to a GPU run. fp32 and fp16 round as on a GPU.


def test_the_interpreter_does_not_outlive_its_tests() -> None:
    """Kernels imported after :func:`interpreted_kernels` are compiled ones again, and so is
    Triton's own library (its ``tl.sum`` is a jit function, decorated at Triton's import).
    First in the file: the module's fixture has not entered its own interpreted context."""
    with interpreted_kernels("pdserve.engine.model.triton_ops") as (module,):
        assert type(module._rope_kernel).__name__ == "InterpretedFunction"
    import triton.language.standard as standard

    import pdserve.engine.model.triton_ops as after

    assert type(after._rope_kernel).__name__ == "JITFunction"
    assert type(standard.sum).__name__ == "JITFunction"


class Ops(NamedTuple):
    module: ModuleType  # pdserve.engine.model.triton_ops
    device: torch.device


@pytest.fixture(scope="module", params=MODES)
def ops(request: pytest.FixtureRequest) -> Iterator[Ops]:
    with kernels_for(request.param, "pdserve.engine.model.triton_ops") as (modules, device):
        yield Ops(modules[0], device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_is_bit_identical_to_torch_on_rows_of_the_fused_qkv(
    ops: Ops, dtype: torch.dtype, tokens: int
) -> None:
    qk, cos, sin = rope_inputs(tokens, dtype, HEADS, KV_HEADS, HEAD_DIM)
    got = ops.module.rope(qk.to(ops.device), cos.to(ops.device), sin.to(ops.device))
    assert got.is_contiguous()
    got, expected = got.cpu(), apply_rope_torch(qk, cos, sin)
    if dtype == torch.bfloat16:  # see INTERPRETER_BF16
        torch.testing.assert_close(got.float(), expected.float(), atol=2**-6, rtol=2**-7)
    elif dtype == torch.float32:  # a GPU may fuse a product and a sum into one FMA
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:  # each product and sum rounds where torch's kernels round
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_matches_torch(ops: Ops, dtype: torch.dtype, tokens: int) -> None:
    norm, x = rms_norm_inputs(tokens, HIDDEN, dtype, row_width=2 * HIDDEN)  # strided rows
    got = ops.module.rms_norm(x.to(ops.device), norm.weight.to(ops.device), norm.eps).cpu()
    expected = norm.torch_forward(x)
    if dtype == torch.float32:  # squares summed in another order: the last bits may differ
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the sum rarely moves a rounding (fp16), then by one step; bf16: INTERPRETER_BF16
        step = 2 * 2**-7 if dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(got.float(), expected.float(), rtol=step, atol=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: FusedOps' CUDA branch")
def test_fused_ops_send_cuda_tensors_to_the_triton_kernels(ops: Ops) -> None:
    loaded = fused_ops()
    if ops.device.type != "cuda" or loaded is None:
        pytest.skip("the CUDA branch, of FusedOps built with a C compiler, on compiled kernels")
    cuda_fused_ops.cache_clear()  # imported afresh: the compiled kernels, not interpreted ones
    try:
        x = torch.randn(3, HIDDEN, device="cuda")
        weight = torch.rand(HIDDEN, device="cuda")
        got = loaded.rms_norm(x, weight, 1e-5)
        assert got is not None and got.is_cuda
        expected = ops.module.rms_norm(x, weight, 1e-5)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    finally:
        cuda_fused_ops.cache_clear()
