"""The native paged decode kernel (engine/csrc/paged_decode.c) against a dense reference,
on the shapes and memory layouts the model really hands it, and its build/fallback path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pdserve.engine.attention.cpu_prefill as cpu_prefill
import pdserve.engine.attention.native as native
import pdserve.engine.native_build as native_build
from pdserve.engine.attention.base import pool_write_rows, write_kv
from pdserve.engine.attention.native import PagedDecodeKernel, load_paged_decode

LAYERS, BLOCK, HEADS, KV_HEADS = 3, 16, 9, 3


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    loaded = load_paged_decode()
    if loaded is None:
        pytest.skip("no C compiler here: the CPU backend falls back to its torch path")
    return loaded


def make_pool(
    lens: list[int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block: int = BLOCK,
    kv_heads: int = KV_HEADS,
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool with random K/V and a random, disjoint block table per sequence."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block) for n in lens]
    free = list(range(sum(needed) + 5))
    random.Random(seed).shuffle(free)
    shape = (len(free), LAYERS, 2, block, kv_heads, head_dim)
    pool = torch.randn(shape, generator=gen).to(dtype)
    return pool, [[free.pop() for _ in range(n)] for n in needed]


def dense_reference(
    q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], lens: list[int], layer: int
) -> torch.Tensor:
    """Gather each sequence's K/V in fp64 and attend with SDPA: ``[B, H * D]``."""
    outs = []
    for row, (table, n) in enumerate(zip(tables, lens, strict=True)):
        kv = pool[table, layer].double()  # [blocks, 2, block size, KVH, D]
        keys = kv[:, 0].flatten(0, 1)[:n].transpose(0, 1)  # [KVH, n, D]
        values = kv[:, 1].flatten(0, 1)[:n].transpose(0, 1)
        query = q[row].double()[:, None]  # [H, 1, D]
        out = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
        outs.append(out.reshape(-1))
    return torch.stack(outs)


def run(
    kernel: PagedDecodeKernel,
    q: torch.Tensor,
    pool: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    layer: int,
    q_rows: list[int] | None = None,
    num_rows: int | None = None,
) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    rows = None if q_rows is None else torch.tensor(q_rows, dtype=torch.int32)
    out = torch.full((num_rows or q.shape[0], q.shape[1] * q.shape[2]), 7.0, dtype=q.dtype)
    kernel(q, pool, padded, torch.tensor(lens, dtype=torch.int32), rows, layer, out)
    return out


def assert_matches_reference(
    kernel: PagedDecodeKernel,
    q: torch.Tensor,
    pool: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    layer: int,
    atol: float,
) -> None:
    out = run(kernel, q, pool, tables, lens, layer)
    expected = dense_reference(q, pool, tables, lens, layer)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block", "atol"),
    [
        (torch.float32, 64, BLOCK, 1e-5),
        (torch.float32, 32, BLOCK, 1e-5),
        (torch.float32, 64, 8, 1e-5),
        # head_dim 64 takes the AVX-512 code where the CPU has it (bf16: AVX-512 BF16),
        # reading blocks in chunks of 16 positions (a block of 8 is a part-filled chunk in
        # memory, a block of 32 two chunks); head_dim 32 always takes the portable code.
        (torch.bfloat16, 64, BLOCK, 2e-2),
        (torch.bfloat16, 64, 8, 2e-2),
        (torch.bfloat16, 64, 32, 2e-2),
        (torch.bfloat16, 32, BLOCK, 2e-2),
    ],
)
def test_matches_dense_reference(
    kernel: PagedDecodeKernel, dtype: torch.dtype, head_dim: int, block: int, atol: float
) -> None:
    # 1 position, a partial block, exactly one block, and many blocks.
    lens = [1, 5, 16, 17, 300]
    pool, tables = make_pool(lens, head_dim, dtype, seed=head_dim, block=block)
    q = torch.randn(len(lens), HEADS, head_dim).to(dtype)
    assert_matches_reference(kernel, q, pool, tables, lens, 1, atol)


ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BOTH_DTYPES = pytest.mark.parametrize("dtype", list(ATOL), ids=["fp32", "bf16"])


@BOTH_DTYPES
def test_more_query_heads_per_kv_head_than_registers_hold(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    """10 query heads on 2 kv heads: 5 per kv head, past what the AVX-512 code keeps in
    registers, so head_dim 64 takes the portable code on every CPU."""
    lens = [1, 17, 90]
    pool, tables = make_pool(lens, 64, dtype, seed=11, kv_heads=2)
    q = torch.randn(len(lens), 10, 64).to(dtype)
    assert_matches_reference(kernel, q, pool, tables, lens, 1, ATOL[dtype])


@BOTH_DTYPES
def test_reads_strided_query_rows_and_writes_only_its_rows(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    """q as the model passes it (a view into the fused qkv rows, one row per token of a
    mixed batch) and decode tokens at flat-batch rows 3 and 0."""
    lens = [40, 9]
    pool, tables = make_pool(lens, 64, dtype, seed=3)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * 64).to(dtype)
    q = qkv[:, : HEADS * 64].view(5, HEADS, 64)  # rows strided by the qkv width
    out = run(kernel, q, pool, tables, lens, layer=2, q_rows=[3, 0], num_rows=5)
    expected = dense_reference(q[[3, 0]], pool, tables, lens, layer=2)
    atol = ATOL[dtype]
    torch.testing.assert_close(out[[3, 0]].double(), expected, atol=atol, rtol=atol)
    assert torch.equal(out[[1, 2, 4]], torch.full((3, HEADS * 64), 7.0, dtype=dtype))


@BOTH_DTYPES
def test_growing_scores_rescale_the_running_softmax(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    """Keys aligned with the query and growing along the sequence: every block raises the
    running max by more than exp's range (scores 0, 2, ..., 254), so a kernel that did not
    rescale would overflow, and the last positions must outweigh all earlier ones."""
    lens = [128]
    pool, tables = make_pool(lens, 64, dtype, seed=5)
    q = torch.ones(1, HEADS, 64, dtype=dtype)
    for position in range(lens[0]):
        block, offset = tables[0][position // BLOCK], position % BLOCK
        pool[block, 0, 0, offset] = position / 4.0
    assert_matches_reference(kernel, q, pool, tables, lens, 0, ATOL[dtype])


@BOTH_DTYPES
def test_positions_past_the_context_never_reach_the_output(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    """A block's unused positions hold whatever an earlier sequence left there, NaN
    included: odd lengths leave one (bf16 takes V rows in pairs, the unpaired last one
    against a weight of zero), a part-filled block many."""
    lens = [1, 5, 17, 33]
    pool, tables = make_pool(lens, 64, dtype, seed=13)
    for table, n in zip(tables, lens, strict=True):
        pool[table[-1], :, :, n % BLOCK or BLOCK :] = float("nan")
    q = torch.randn(len(lens), HEADS, 64).to(dtype)
    assert_matches_reference(kernel, q, pool, tables, lens, 1, ATOL[dtype])


@BOTH_DTYPES
def test_stored_kv_rows_equal_index_copy(kernel: PagedDecodeKernel, dtype: torch.dtype) -> None:
    """The step's K/V as the model passes them (views into the fused qkv rows) land where
    ``write_kv``'s index_copy_ puts them, and nowhere else."""
    tokens, head_dim = 7, 64
    pool, _ = make_pool([16 * 6], head_dim, dtype, seed=17)
    slots = torch.tensor([0, 5, 16, 17, 31, 40, 95])
    rows = pool_write_rows(slots, BLOCK, LAYERS)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim).to(dtype)
    k = qkv[:, HEADS * head_dim : (HEADS + KV_HEADS) * head_dim].view(tokens, KV_HEADS, -1)
    v = qkv[:, (HEADS + KV_HEADS) * head_dim :].view(tokens, KV_HEADS, -1)
    expected = pool.clone()
    write_kv(expected, 2, rows, k, v)
    kernel.store_kv(pool, 2, rows, k, v)
    assert torch.equal(pool, expected)


def test_kv_rows_outside_the_pool_are_refused_untouched(kernel: PagedDecodeKernel) -> None:
    pool, _ = make_pool([16 * 2], 64, torch.float32, seed=19)
    before = pool.clone()
    kv = torch.randn(2, KV_HEADS, 64)
    last_block = pool.shape[0] - 1
    rows = pool_write_rows(torch.tensor([0, last_block * BLOCK + 3]), BLOCK, LAYERS)
    with pytest.raises(IndexError, match="outside the pool"):
        kernel.store_kv(pool, LAYERS, rows, kv, kv)  # layer 3 of 3: past the last block
    assert torch.equal(pool, before)


@BOTH_DTYPES
def test_fewer_sequences_than_threads_split_by_kv_head(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    lens = [70]
    pool, tables = make_pool(lens, 64, dtype, seed=9)
    q = torch.randn(1, HEADS, 64).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one sequence, two threads: (sequence, kv head) work items
    try:
        assert_matches_reference(kernel, q, pool, tables, lens, 1, ATOL[dtype])
    finally:
        torch.set_num_threads(threads)


def test_without_a_compiler_the_loader_reports_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # no library built here yet
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    assert load_paged_decode.__wrapped__() is None
    assert "no C compiler" in caplog.text


def test_a_failed_build_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, "-include", "/nonexistent/pd.h"))
    assert load_paged_decode.__wrapped__() is None
    assert "failed" in caplog.text and "/nonexistent/pd.h" in caplog.text
    assert not list(tmp_path.rglob("*.so")), "a failed build must leave no library behind"


@pytest.mark.parametrize("internal_op", [True, False])
def test_chunk_after_a_prefix_matches_one_masked_attention(
    monkeypatch: pytest.MonkeyPatch, internal_op: bool
) -> None:
    """Two unmasked flash calls merged by log-sum-exp == one call with the bottom-right mask
    (also through the math fallback used when torch lacks the internal op)."""
    if not internal_op:
        monkeypatch.setattr(cpu_prefill, "_FLASH", None)
    gen = torch.Generator().manual_seed(11)
    prefix, n = 37, 21
    q = torch.randn(n, HEADS, 16, generator=gen)
    keys, values = (torch.randn(prefix + n, KV_HEADS, 16, generator=gen) for _ in range(2))
    got = cpu_prefill.attend_after_prefix(
        q,
        keys[prefix:],
        values[prefix:],
        keys[:prefix].transpose(0, 1),
        values[:prefix].transpose(0, 1),
    )
    mask = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        enable_gqa=True,
    )  # [H, n, D]
    torch.testing.assert_close(got, expected.transpose(0, 1).reshape(n, -1), atol=1e-5, rtol=1e-5)
