"""int8 KV pools (``kv_codec/int8_rows.py``): the native kernels and the torch paths read the
int8 rows and their scales in place. Each is checked against a dense attention over the K/V
as the pool holds them (dequantized, in fp64 or fp32), and the native store against
``quantize_rows``, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import layout_chunks
from pdserve.engine.attention.base import pool_write_rows, write_kv
from pdserve.engine.attention.cuda import FlashAttnBackend
from pdserve.engine.attention.native import PagedDecodeKernel, load_paged_decode
from pdserve.engine.attention.paged_prefill import PagedPrefillKernel, load_paged_prefill
from pdserve.kv_codec import dequantize_rows, quantize_rows
from tests.paged_cases import Case, Chunk, make_case
from tests.unit.test_attention import (
    BACKENDS,
    BLOCK_SIZE,
    MIXED_BATCHES,
    SHAPE,
    TREES,
    dense_reference,
    run_backend,
    tree_reference,
)

LAYERS, KV_HEADS = 3, 3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BOTH_DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["fp32", "bf16"])


@pytest.fixture(scope="module")
def decode_kernel() -> PagedDecodeKernel:
    loaded = load_paged_decode()
    if loaded is None:
        pytest.skip("no C compiler here: the CPU backend falls back to its torch path")
    return loaded


@pytest.fixture(scope="module")
def prefill_kernel() -> PagedPrefillKernel:
    loaded = load_paged_prefill()
    if loaded is None:
        pytest.skip("no C compiler here: the CPU backend keeps torch's prefill kernel")
    return loaded


def stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an int8 pool gives it back, in fp32."""
    return dequantize_rows(quantize_rows(x), torch.float32)


# -- the store -------------------------------------------------------------------------------


@BOTH_DTYPES
def test_native_store_writes_what_quantize_rows_writes(
    decode_kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    """The step's K/V as the model passes them (views into the fused qkv rows), with an
    outlier channel, a large row and an all-zero row, land as ``write_kv`` (torch's
    ``quantize_rows``) puts them, bit for bit, and nowhere else."""
    tokens, heads, head_dim = 7, 9, 64
    pool = torch.randint(-127, 128, (6, LAYERS, 2, 16, KV_HEADS, head_dim + 2), dtype=torch.int8)
    slots = torch.tensor([0, 5, 16, 17, 31, 40, 95])
    rows = pool_write_rows(slots, 16, LAYERS)
    qkv = torch.randn(tokens, (heads + 2 * KV_HEADS) * head_dim, generator=_gen(1))
    qkv[:, heads * head_dim + 5] *= 50.0  # an outlier K channel
    qkv[2] *= 1e3
    qkv[4, (heads + KV_HEADS) * head_dim :][:head_dim] = 0.0  # V of token 4, kv head 0
    qkv = qkv.to(dtype)
    k = qkv[:, heads * head_dim : (heads + KV_HEADS) * head_dim].view(tokens, KV_HEADS, -1)
    v = qkv[:, (heads + KV_HEADS) * head_dim :].view(tokens, KV_HEADS, -1)
    expected = pool.clone()
    write_kv(expected, 2, rows, k, v)
    decode_kernel.store_kv(pool, 2, rows, k, v)
    assert torch.equal(pool, expected)
    zero_row = pool[31 // 16, 2, 1, 31 % 16, 0]  # token 4 went to slot 31
    assert torch.equal(zero_row, torch.zeros(head_dim + 2, dtype=torch.int8)), "scale +0"


# -- the backends over an int8 pool ----------------------------------------------------------


def on_int8_pool(case: Case, dtype: torch.dtype) -> tuple[Case, Case]:
    """``case`` in ``dtype`` with an int8 pool holding each chunk's cached prefix; and the
    case the reference attends: its K/V as that pool gives them back, in fp32."""
    case = case.to(dtype)
    pool = quantize_rows(case.pool)  # [blocks, L, 2, bs, KVH, D + 2]
    for block, offset, k, v in case.rows(cached=True):
        pool[block, 1, 0, offset] = quantize_rows(k)
        pool[block, 1, 1, offset] = quantize_rows(v)
    ours = Case(case.chunks, case.keys, case.values, case.q, pool)
    reference = Case(
        case.chunks,
        [stored(k) for k in case.keys],
        [stored(v) for v in case.values],
        case.q.float(),
        pool,
    )
    return ours, reference


@BOTH_DTYPES
@pytest.mark.parametrize("backend_name", ["cpu-native", "cpu-grouped"])
@pytest.mark.parametrize("batch", sorted(MIXED_BATCHES))
def test_backends_attend_the_int8_rows(backend_name: str, batch: str, dtype: torch.dtype) -> None:
    """Decodes and prefill chunks, fresh and after a cached prefix: the native kernels
    (decode, prefill) and torch's paths (gather, dequantize, SDPA) over one int8 pool."""
    ours, reference = on_int8_pool(make_case(SHAPE, MIXED_BATCHES[batch], seed=3), dtype)
    out = run_backend(BACKENDS[backend_name](), ours, layer=1)
    assert out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), dense_reference(reference), atol=tolerance, rtol=0)


@BOTH_DTYPES
@pytest.mark.parametrize("backend_name", ["cpu-native", "cpu-grouped"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_chunks_attend_the_int8_rows(tree: str, backend_name: str, dtype: torch.dtype) -> None:
    """Token trees and chains (speculative verification) among decodes and a prefill chunk:
    rows by ancestry (the native prefill kernel), chain rows as decodes (the native decode
    kernel), and torch's masked SDPA."""
    parents = TREES[tree]
    case = make_case(SHAPE, [(9, 1), (21, len(parents)), (0, 5), (6, len(parents))], seed=2)
    trees = {1: parents, 3: parents}
    case.chunks = [
        Chunk(c.start_pos, c.num_tokens, c.block_table, trees.get(i, ()))
        for i, c in enumerate(case.chunks)
    ]
    ours, reference = on_int8_pool(case, dtype)
    out = run_backend(BACKENDS[backend_name](), ours, layer=1)
    tolerance = TOLERANCE[dtype]
    expected = tree_reference(reference, trees)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)


# -- the kernels on the model's shapes --------------------------------------------------------


def int8_pool(
    lens: list[int], head_dim: int, block: int, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """An int8 pool of random K/V (an outlier channel in K) and a shuffled, disjoint block
    table per sequence."""
    needed = [-(-n // block) for n in lens]
    free = list(range(sum(needed) + 3))
    random.Random(seed).shuffle(free)
    values = torch.randn(len(free), LAYERS, 2, block, KV_HEADS, head_dim, generator=_gen(seed))
    values[:, :, 0, :, :, 3] *= 20.0
    return quantize_rows(values), [[free.pop() for _ in range(n)] for n in needed]


def decode_reference(
    q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], lens: list[int], layer: int
) -> torch.Tensor:
    """Each sequence's dequantized K/V in fp64, attended with SDPA: ``[B, H * D]``."""
    outs = []
    for row, (table, n) in enumerate(zip(tables, lens, strict=True)):
        kv = dequantize_rows(pool[table, layer], torch.float64)  # [blocks, 2, bs, KVH, D]
        keys = kv[:, 0].flatten(0, 1)[:n].transpose(0, 1)  # [KVH, n, D]
        values = kv[:, 1].flatten(0, 1)[:n].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q[row].double()[:, None], keys, values, enable_gqa=True
        )  # [H, 1, D]
        outs.append(out.reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block", "heads"),
    [
        # head_dim 64 takes the AVX-512 code where the CPU has it (up to 4 query heads per kv
        # head), the portable code's head_dim-64 copy past that; other head_dims the generic
        (torch.float32, 64, 16, 9),
        (torch.float32, 64, 8, 9),
        (torch.float32, 64, 16, 15),
        (torch.float32, 32, 16, 9),
        (torch.bfloat16, 64, 16, 9),
        (torch.bfloat16, 64, 32, 9),
        (torch.bfloat16, 64, 16, 15),
        (torch.bfloat16, 32, 16, 9),
    ],
)
def test_decode_kernel_matches_the_dequantized_reference(
    decode_kernel: PagedDecodeKernel, dtype: torch.dtype, head_dim: int, block: int, heads: int
) -> None:
    lens = [1, 5, block, block + 1, 300]
    pool, tables = int8_pool(lens, head_dim, block, seed=head_dim + block)
    for table, n in zip(tables, lens, strict=True):  # unused positions are never read
        pool[table[-1], :, :, n % block or block :, :, head_dim:] = -1  # NaN scales
    q = torch.randn(len(lens), heads, head_dim, generator=_gen(5)).to(dtype)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.full((len(lens), heads * head_dim), 7.0, dtype=dtype)
    decode_kernel(q, pool, padded, torch.tensor(lens, dtype=torch.int32), None, 2, out)
    expected = decode_reference(q, pool, tables, lens, layer=2)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@BOTH_DTYPES
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 37), (3, 20), (16, 16), (250, 90)])
def test_prefill_kernel_matches_the_dequantized_reference(
    prefill_kernel: PagedPrefillKernel, dtype: torch.dtype, start: int, n: int
) -> None:
    """A chunk of ``n`` tokens after ``start`` cached positions, fp32 or bf16 queries."""
    pool, (table,) = int8_pool([start + n], 64, 16, seed=n)
    q = torch.randn(n, 9, 64, generator=_gen(n)).to(dtype)
    out = torch.full((n, 9 * 64), 7.0, dtype=dtype)
    prefill_kernel(q, pool, torch.tensor(table, dtype=torch.int32), start, 1, out)
    keys_values = dequantize_rows(pool[table, 1], torch.float64)  # [blocks, 2, bs, KVH, D]
    keys = keys_values[:, 0].flatten(0, 1)[: start + n].transpose(0, 1)
    values = keys_values[:, 1].flatten(0, 1)[: start + n].transpose(0, 1)
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    expected = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys, values, attn_mask=visible, enable_gqa=True
    )  # [H, n, D]
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.double(), expected.transpose(0, 1).reshape(n, -1), atol=tolerance, rtol=tolerance
    )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_flash_attn_backend_refuses_an_int8_pool() -> None:
    """Written for CUDA, never run here: it has no int8 path, and says so rather than
    reading int8 rows as values. Its metadata builds on CPU; the refusal comes first."""
    backend = FlashAttnBackend(lambda *args, **kwargs: None)
    ours, _ = on_int8_pool(make_case(SHAPE, [(3, 1)], seed=1), torch.float32)
    layout = layout_chunks(ours.chunks, BLOCK_SIZE)
    meta = backend.build_metadata(layout, BLOCK_SIZE, 3, torch.device("cpu"))
    k = v = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="no int8 pool path"):
        backend.forward(1, ours.q, k, v, ours.pool, meta)
