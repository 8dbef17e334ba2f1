"""Paged attention backends vs a dense reference (SDPA with an explicit mask)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import get_backend, layout_chunks
from pdserve.engine.attention.base import AttentionBackend, slot_mapping, token_positions
from pdserve.engine.attention.cpu import CpuAttentionBackend
from pdserve.engine.attention.cpu_plan import plan_native_decodes
from tests.paged_cases import Case, Chunk, PoolShape, make_case

NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 3, 4, 2, 6, 8, 64
SHAPE = PoolShape(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM)


def dense_reference(case: Case) -> torch.Tensor:
    outs, token = [], 0
    for chunk, k, v in zip(case.chunks, case.keys, case.values, strict=True):
        n, start = chunk.num_tokens, chunk.start_pos
        q = case.q[token : token + n].transpose(0, 1)  # [H, n, D]
        keys = k.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)  # [H, ctx, D]
        values = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        query_pos = torch.arange(start, start + n)[:, None]
        mask = torch.arange(start + n)[None, :] <= query_pos  # [n, ctx]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        outs.append(out.transpose(0, 1).reshape(n, HEADS * HEAD_DIM))
        token += n
    return torch.cat(outs)


def run_backend(backend: AttentionBackend, case: Case, layer: int) -> torch.Tensor:
    layout = layout_chunks(case.chunks, BLOCK_SIZE)
    meta = backend.build_metadata(layout, BLOCK_SIZE, NUM_LAYERS, torch.device("cpu"))
    new_k, new_v = case.new_kv()
    return backend.forward(layer, case.q, new_k, new_v, case.pool, meta)


BACKENDS = {
    "cpu-native": lambda: get_backend("cpu-native"),
    "cpu-grouped": lambda: get_backend("cpu-grouped"),
    "cpu-padded": lambda: get_backend("cpu-padded"),
    "cpu-per-seq": lambda: get_backend("cpu-per-seq"),
    # Budget of 40 key positions: several groups per step, some masked, some not.
    "cpu-grouped-small": lambda: CpuAttentionBackend("grouped", group_tokens=40),
}
MIXED_BATCHES = {
    "decodes_first": [(9, 1), (0, 1), (30, 1), (0, 7), (5, 6), (12, 16)],
    "decodes_between": [(3, 5), (17, 1), (8, 9), (2, 1), (0, 3)],
    "decode_only": [(1, 1), (15, 1), (16, 1), (40, 1), (14, 1), (2, 1), (15, 1)],
    "one_chunk_mid_block": [(6, 11)],
    "fresh_prefill_only": [(0, 13), (0, 2)],
}


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize("batch", sorted(MIXED_BATCHES))
def test_matches_dense_reference(backend_name: str, batch: str) -> None:
    backend = BACKENDS[backend_name]()  # reused across cases: its scratch buffer too
    for seed in range(3):
        case = make_case(SHAPE, MIXED_BATCHES[batch], seed)
        case.write_cached_prefix(layer=1)
        out = run_backend(backend, case, layer=1)
        torch.testing.assert_close(out, dense_reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["cpu-native", "cpu-grouped"])
@pytest.mark.parametrize("batch", sorted(MIXED_BATCHES))
def test_bf16_matches_dense_reference(backend_name: str, batch: str) -> None:
    # bf16 takes its own paths: the decode kernel's bf16 loads; for prefill chunks the
    # native prefill kernel's bf16 loads (torch's flash kernel on CPUs with AMX, and with
    # cpu-grouped).
    case = make_case(SHAPE, MIXED_BATCHES[batch], seed=5).to(torch.bfloat16)
    case.write_cached_prefix(layer=1)
    out = run_backend(BACKENDS[backend_name](), case, layer=1)
    assert out.dtype == torch.bfloat16
    expected = dense_reference(case.to(torch.float32))  # the same rounded inputs
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_new_kv_lands_in_its_slots_and_layer_only(backend_name: str) -> None:
    case = make_case(SHAPE, MIXED_BATCHES["decodes_first"], seed=7)
    before = case.pool.clone()
    run_backend(BACKENDS[backend_name](), case, layer=2)
    touched = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, dtype=torch.bool)
    for block, offset, k, v in case.rows(cached=False):
        torch.testing.assert_close(case.pool[block, 2, 0, offset], k, rtol=0, atol=0)
        torch.testing.assert_close(case.pool[block, 2, 1, offset], v, rtol=0, atol=0)
        touched[block, 2, :, offset] = True
    assert torch.equal(case.pool[~touched], before[~touched])


def test_native_decode_plan_takes_the_longest_context_first() -> None:
    chunks = [
        Chunk(start_pos=5, num_tokens=1, block_table=(0, 1)),
        Chunk(start_pos=12, num_tokens=1, block_table=(2, 3, 4, 5)),
        Chunk(start_pos=0, num_tokens=3, block_table=(6,)),  # a prefill chunk: rows 2..4
        Chunk(start_pos=8, num_tokens=1, block_table=(7, 8, 9)),
    ]
    plan = plan_native_decodes(layout_chunks(chunks, BLOCK_SIZE), torch.device("cpu"))
    assert plan is not None and plan.num_seqs == 3
    assert plan.lens.tolist() == [13, 9, 6]
    assert plan.q_rows is not None and plan.q_rows.tolist() == [1, 5, 0]
    assert plan.tables.tolist() == [[2, 3, 4, 5], [7, 8, 9, 0], [0, 1, 0, 0]]


def test_short_block_table_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 3"):
        layout_chunks([Chunk(start_pos=8, num_tokens=1, block_table=(0, 1))], BLOCK_SIZE)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="cpu-padded"):
        get_backend("tpu")


def test_auto_is_cpu_on_cpu() -> None:
    assert get_backend("auto", "cpu").name.startswith("cpu")


# Token trees (speculative verification): the parent row of each row, -1 for the root.
TREES = {
    "chain": (-1, 0, 1, 2, 3),
    "branches": (-1, 0, 1, 0, 3, 0, 1),  # root -> a -> b, root -> c -> d, root -> e, a -> f
    "wide": (-1, 0, 0, 0, 0, 0, 0, 0, 0),
    "deep_then_side": (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1, 18),
}


def tree_reference(case: Case, parents_of: dict[int, tuple[int, ...]]) -> torch.Tensor:
    """Row r of a tree chunk sees the prefix, then chunk rows that are r or its ancestors."""
    outs, token = [], 0
    for i, (chunk, k, v) in enumerate(zip(case.chunks, case.keys, case.values, strict=True)):
        n, start = chunk.num_tokens, chunk.start_pos
        q = case.q[token : token + n].transpose(0, 1)  # [H, n, D]
        keys = k.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)  # [H, ctx, D]
        values = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        mask[:, :start] = True
        for row in range(n):
            if i in parents_of:
                ancestor = row
                while ancestor >= 0:
                    mask[row, start + ancestor] = True
                    ancestor = parents_of[i][ancestor]
            else:
                mask[row, : start + row + 1] = True
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        outs.append(out.transpose(0, 1).reshape(n, HEADS * HEAD_DIM))
        token += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_name", ["cpu-native", "cpu-grouped"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_chunks_attend_by_ancestry(tree: str, backend_name: str, dtype: torch.dtype) -> None:
    """A tree chunk among decodes and a prefill chunk: each tree row sees the cached prefix
    and its ancestors only (the native kernel by ancestor bits, torch by an explicit mask)."""
    parents = TREES[tree]
    spans = [(9, 1), (21, len(parents)), (0, 5), (6, len(parents))]
    case = make_case(SHAPE, spans, seed=len(parents))
    trees = {1: parents, 3: parents}
    case.chunks = [
        Chunk(c.start_pos, c.num_tokens, c.block_table, trees.get(i, ()))
        for i, c in enumerate(case.chunks)
    ]
    case = case.to(dtype)
    case.write_cached_prefix(layer=1)
    out = run_backend(BACKENDS[backend_name](), case, layer=1)
    expected = tree_reference(case.to(torch.float32), trees)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_chain_is_a_causal_chunk() -> None:
    """Positions of a chain's rows run on like a prefill chunk's; a branch's repeat a depth."""
    chain = Chunk(7, 4, (0, 1, 2), row_parents=(-1, 0, 1, 2))
    branched = Chunk(7, 4, (0, 1, 2), row_parents=(-1, 0, 0, 2))
    assert token_positions(layout_chunks([chain], BLOCK_SIZE)) == [7, 8, 9, 10]
    assert token_positions(layout_chunks([branched], BLOCK_SIZE)) == [7, 8, 8, 9]
    slots = slot_mapping(layout_chunks([branched], BLOCK_SIZE), BLOCK_SIZE)
    assert slots == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]  # by row, not by depth
