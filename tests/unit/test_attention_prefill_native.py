"""The native paged prefill kernel (engine/csrc/paged_prefill.c), fp32 and bf16, against
a causal attention in fp64, on paged pools with shuffled block tables."""

from __future__ import annotations

import random

import pytest
import torch

import pdserve.engine.attention.paged_prefill as paged_prefill
from pdserve.engine.attention.paged_prefill import PagedPrefillKernel, load_paged_prefill
from pdserve.kv_codec import ROW_SCALE_BYTES

LAYERS = 3


@pytest.fixture(scope="module")
def kernel() -> PagedPrefillKernel:
    loaded = load_paged_prefill()
    if loaded is None:
        pytest.skip("no C compiler here: the CPU backend keeps torch's prefill kernel")
    return loaded


def make_case(
    start: int, n: int, heads: int, kv_heads: int, head_dim: int, block: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool, table, q): a pool of random K/V, a shuffled table covering start + n positions,
    and q rows as a strided view (every row of a wider tensor, as the fused qkv gives)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-(start + n) // block)
    ids = list(range(blocks + 4))
    random.Random(seed).shuffle(ids)
    pool = torch.randn(len(ids), LAYERS, 2, block, kv_heads, head_dim, generator=gen)
    table = torch.tensor(ids[:blocks], dtype=torch.int32)
    q = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]
    return pool, table, q


def causal_reference(
    pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, start: int, layer: int
) -> torch.Tensor:
    """Token i of the chunk (position start + i) over positions 0 .. start + i, in fp64."""
    n, heads, head_dim = q.shape
    kv_heads, end = pool.shape[4], start + n
    kv = pool[table.long(), layer].double()  # [blocks, 2, block, KVH, D]
    keys = kv[:, 0].flatten(0, 1)[:end].transpose(0, 1)  # [KVH, end, D]
    values = kv[:, 1].flatten(0, 1)[:end].transpose(0, 1)
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * head_dim**-0.5  # [H, n, end]
    future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    probs = scores.masked_fill(future, -torch.inf).softmax(-1)
    return (probs @ values).transpose(0, 1).reshape(n, heads * head_dim)


def run(kernel: PagedPrefillKernel, pool, table, q, start: int, layer: int) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), 7.0, dtype=q.dtype)
    kernel(q, pool, table, start, layer, out)
    return out


@pytest.mark.parametrize(
    ("start", "n"),
    [(0, 1), (0, 2), (0, 16), (0, 37), (0, 300), (5, 1), (3, 20), (16, 16), (100, 7), (250, 90)],
)
def test_matches_causal_reference(kernel: PagedPrefillKernel, start: int, n: int) -> None:
    # Lengths off and on the 16-token item and block edges; chunks after a prefix.
    pool, table, q = make_case(start, n, heads=9, kv_heads=3, head_dim=64, block=16, seed=n)
    out = run(kernel, pool, table, q, start, layer=1)
    expected = causal_reference(pool, table, q, start, layer=1)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block"),
    [(8, 2, 128, 16), (8, 1, 32, 8), (4, 4, 64, 32), (16, 2, 64, 16)],
)
def test_other_model_shapes(
    kernel: PagedPrefillKernel, heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    # Groups of 4 and 8 query heads (more than the 3 vectors a tile holds), none (MHA),
    # other head dims and block sizes.
    pool, table, q = make_case(45, 40, heads, kv_heads, head_dim, block, seed=heads)
    out = run(kernel, pool, table, q, start=45, layer=2)
    expected = causal_reference(pool, table, q, start=45, layer=2)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_large_scores_keep_the_softmax_finite(kernel: PagedPrefillKernel) -> None:
    # Scores in the hundreds: without the running max, exp would overflow to inf.
    pool, table, q = make_case(0, 64, heads=9, kv_heads=3, head_dim=64, block=16, seed=3)
    pool *= 30
    out = run(kernel, pool, table, q, start=0, layer=0)
    assert torch.isfinite(out).all()
    expected = causal_reference(pool, table, q, start=0, layer=0)
    # Outputs reach ~120 here; torch's fp32 SDPA is 5e-4 off the fp64 result too.
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 37), (3, 20), (250, 90)])
def test_bf16_within_its_rounding_of_the_exact_result(
    kernel: PagedPrefillKernel, start: int, n: int
) -> None:
    # bf16 q and pool are exact in fp32; with AVX-512 BF16 the scores are bf16 pair products
    # summed in fp32 and, as GPU flash attention does, the softmax weights are rounded to
    # bf16 for the weighted sum of V (sums in fp32): each weight is then off by at most
    # 2^-9 of itself, so the output by at most 2^-9 max|V|, plus its own rounding, once.
    if not PagedPrefillKernel.handles(torch.bfloat16, _pool(64, torch.bfloat16)):
        pytest.skip("no AVX-512 BF16 here: bf16 chunks stay on torch's kernel")
    pool, table, q = make_case(start, n, heads=9, kv_heads=3, head_dim=64, block=16, seed=n)
    pool, q = pool.to(torch.bfloat16), q.to(torch.bfloat16)
    out = run(kernel, pool, table, q, start, layer=1)
    assert out.dtype == torch.bfloat16
    weights_error = 2**-9 * float(pool[:, 1, 1].abs().max())
    expected = causal_reference(pool, table, q, start, layer=1)
    torch.testing.assert_close(out.double(), expected, atol=weights_error, rtol=2**-8)
    fp32 = run(kernel, pool.float(), table, q.float(), start, layer=1)
    torch.testing.assert_close(out.float(), fp32, atol=weights_error, rtol=2**-8)


@pytest.mark.parametrize(
    ("flags", "bf16_handled", "bf16_preferred"),
    [
        (frozenset({"avx512_bf16"}), True, True),  # Zen 4: our vdpbf16ps path
        (frozenset({"avx512_bf16", "amx_bf16"}), True, False),  # AMX: torch's kernel on tiles
        (frozenset({"avx512f"}), False, False),  # no bf16 instructions: torch's kernel
    ],
)
def test_which_chunks_take_this_kernel(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], bf16_handled: bool, bf16_preferred: bool
) -> None:
    monkeypatch.setattr(paged_prefill, "cpu_flags", lambda: flags)
    bf16 = torch.bfloat16
    assert PagedPrefillKernel.handles(bf16, _pool(64, bf16)) == bf16_handled
    assert PagedPrefillKernel.preferred_for(bf16, _pool(64, bf16)) == bf16_preferred
    assert PagedPrefillKernel.preferred_for(torch.float32, _pool(64)), "fp32 always"
    for dtype in (torch.float32, bf16):  # int8 pools: fp32 arithmetic, any CPU
        assert PagedPrefillKernel.preferred_for(dtype, _pool(64, torch.int8)), f"{dtype}"
    assert not PagedPrefillKernel.handles(torch.float32, _pool(60)), "head_dim not 8 * k"
    assert not PagedPrefillKernel.handles(torch.float16, _pool(64, torch.float16))
    assert not PagedPrefillKernel.handles(torch.float32, _pool(64, bf16)), "mixed fp32 / bf16"


def _pool(head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty pool of ``dtype`` whose rows hold ``head_dim`` values (int8: and a scale)."""
    row = head_dim + (ROW_SCALE_BYTES if dtype == torch.int8 else 0)
    return torch.zeros(2, 1, 2, 16, 3, row, dtype=dtype)
