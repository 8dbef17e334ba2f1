"""The ``cuda-triton`` attention kernels under Triton's interpreter on CPU tensors (and
compiled, on a GPU where there is one) against a dense reference written here: each chunk's
true K/V (before they went through the pool), a masked softmax in fp32.

Shapes are tiny (the interpreter runs each program in Python) but cross every boundary: block
size 4 with 16-key tiles, 16-row query tiles, decode splits of 16 keys, chunks of odd lengths
after cached prefixes, grouped-query heads (4 over 2), a non-zero layer of the pool.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch

from pdserve.engine.attention import get_backend, registry
from pdserve.engine.attention.base import (
    AttentionBackend,
    layout_chunks,
    token_positions,
    tree_mask,
)
from pdserve.engine.attention.cuda import FlashAttnBackend
from pdserve.engine.attention.kv_format import INT8
from pdserve.engine.attention.registry import auto_backend
from pdserve.engine.attention.triton import TritonTiles
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.runner import allocate_kv_cache
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.kv_codec import quantize_rows
from tests import paged_cases
from tests.paged_cases import Case, PoolShape
from tests.triton_interpreter import MODES, kernels_for
from tests.unit.test_packed_linear import TINY, tiny_model

NUM_LAYERS, LAYER, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 2, 1, 4, 2, 4, 16, 40
SHAPE = PoolShape(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM)
# Tolerances per dtype: the reference sees the same rounded inputs; the kernel rounds the
# softmax weights to the dtype for the P.V product (as FlashAttention does) and its output.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1.5e-2},
}


def make_case(
    spans: list[tuple[int, int]], dtype: torch.dtype, seed: int, parents: tuple[int, ...] = ()
) -> Case:
    """A step of ``spans`` (``tests/paged_cases.py``) with each chunk's cached prefix written
    into the pool's layer ``LAYER``."""
    case = paged_cases.make_case(SHAPE, spans, seed, dtype, parents)
    case.write_cached_prefix(LAYER)
    return case


def reference(case: Case) -> torch.Tensor:
    """Dense masked softmax in fp32 over each chunk's true K/V: ``[T, H * D]``."""
    outs, first = [], 0
    group = HEADS // KV_HEADS
    for chunk, k, v in zip(case.chunks, case.keys, case.values, strict=True):
        n, start = chunk.num_tokens, chunk.start_pos
        q = case.q[first : first + n].float().transpose(0, 1)  # [H, n, D]
        keys = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, ctx, D]
        vals = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        allowed = torch.ones(n, start + n, dtype=torch.bool)
        if chunk.row_parents:
            allowed[:, start:] = tree_mask(chunk.row_parents, torch.device("cpu"))
        else:
            allowed = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        scores = q @ keys.transpose(1, 2) * HEAD_DIM**-0.5  # [H, n, ctx]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append((probs @ vals).transpose(0, 1).reshape(n, HEADS * HEAD_DIM))
        first += n
    return torch.cat(outs)


# Small enough for these shapes to cross query tiles, key tiles and decode splits.
SMALL_TILES = TritonTiles(
    query_rows=16, key_tokens=16, key_tokens_fp32=16, split_tokens=16, max_splits=8
)


class Kernels(NamedTuple):
    backend: ModuleType  # pdserve.engine.attention.triton.backend
    device: torch.device

    def tiled(self, **tiles: int) -> Any:
        """A backend with :data:`SMALL_TILES`, changed by ``tiles``."""
        return self.backend.TritonAttentionBackend(dataclasses.replace(SMALL_TILES, **tiles))


@pytest.fixture(scope="module", params=MODES)
def kernels(request: pytest.FixtureRequest) -> Iterator[Kernels]:
    with kernels_for(request.param, "pdserve.engine.attention.triton.backend") as (mods, dev):
        yield Kernels(mods[0], dev)


def run(kernels: Kernels, case: Case, **tiles: int) -> torch.Tensor:
    """The backend's output for ``case`` (on the CPU); ``case.pool`` holds the stored K/V."""
    backend, device = kernels.tiled(**tiles), kernels.device
    layout = layout_chunks(case.chunks, BLOCK_SIZE)
    meta = backend.build_metadata(layout, BLOCK_SIZE, NUM_LAYERS, device)
    k, v = case.new_kv()
    pool = case.pool.to(device)
    out: torch.Tensor = backend.forward(
        LAYER, case.q.to(device), k.to(device), v.to(device), pool, meta
    )
    case.pool.copy_(pool)
    return out.cpu()


DTYPES = list(TOLERANCES)
CASES = {
    # Several prompts of odd lengths in one launch, none cached: 5 tokens, 11, 3, 21 (two
    # query tiles of 8 tokens x 2 heads, and a short last one).
    "prefill": [(0, 5), (0, 11), (0, 3), (0, 21)],
    # Chunks after cached prefixes that end mid-block, and one without.
    "prefill_after_prefix": [(7, 5), (0, 9), (13, 6), (2, 17)],
    # One split each (contexts up to 16 keys).
    "decode_short": [(2, 1), (5, 1), (15, 1)],
    # Up to 61 keys: 4 splits of 16; the shorter sequences leave pieces empty.
    "decode_long": [(60, 1), (3, 1), (33, 1), (17, 1)],
    # Decode tokens and prefill chunks of one step.
    "mixed": [(5, 1), (7, 9), (40, 1), (0, 6)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_the_dense_reference(
    kernels: Kernels, name: str, dtype: torch.dtype
) -> None:
    case = make_case(CASES[name], dtype, seed=len(name))
    got = run(kernels, case)
    assert got.dtype == dtype and got.shape == (case.q.shape[0], HEADS * HEAD_DIM)
    torch.testing.assert_close(got.float(), reference(case), **TOLERANCES[dtype])


def test_decode_splits_merge_to_the_unsplit_result(kernels: Kernels) -> None:
    case = make_case(CASES["decode_long"], torch.float32, seed=3)
    split = run(kernels, case)  # 4 splits
    whole = run(kernels, case, split_tokens=1024)  # 1 split: no merge kernel
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


def test_token_tree_rows_attend_the_prefix_and_their_ancestors(
    kernels: Kernels,
) -> None:
    parents = (-1, 0, 0, 1, 2, 1, 5)  # two branches, one of depth 3
    case = make_case([(9, 1), (0, 4), (6, len(parents))], torch.float32, seed=5, parents=parents)
    torch.testing.assert_close(run(kernels, case), reference(case), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_writes_each_token_to_its_slot_and_nothing_else(
    kernels: Kernels, dtype: torch.dtype
) -> None:
    case = make_case([(3, 6), (9, 1), (0, 5)], dtype, seed=7)
    before = case.pool.clone()
    # K and V as strided views of one fused projection, as the model hands them.
    k, v = case.new_kv()
    fused = torch.cat((k, v), dim=1).to(kernels.device)  # [T, 2 * KVH, D]
    layout = layout_chunks(case.chunks, BLOCK_SIZE)
    meta = kernels.tiled().build_metadata(layout, BLOCK_SIZE, NUM_LAYERS, kernels.device)
    pool = case.pool.to(kernels.device)
    kernels.backend.store_kv(
        pool, LAYER, meta.slot_mapping, fused[:, :KV_HEADS], fused[:, KV_HEADS:]
    )
    expected = before.clone()
    for block, offset, ck, cv in case.rows(cached=False):
        expected[block, LAYER, :, offset] = torch.stack((ck, cv))
    assert torch.equal(pool.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_int8_pool_reads_as_its_dequantized_values(kernels: Kernels, dtype: torch.dtype) -> None:
    """Rows quantized by the store (the step's K/V) and before it (the prefixes, the pool's
    noise) are read back dequantized: the reference sees K/V as the pool stores them."""
    case = make_case(CASES["mixed"], dtype, seed=9)
    got = run(kernels, dataclasses.replace(case, pool=quantize_rows(case.pool)))
    keys = [INT8.as_stored(k) for k in case.keys]
    values = [INT8.as_stored(v) for v in case.values]
    expected = reference(dataclasses.replace(case, keys=keys, values=values))
    torch.testing.assert_close(got.float(), expected, **TOLERANCES[dtype])


def test_refuses_a_pool_of_another_dtype(kernels: Kernels) -> None:
    case = make_case([(0, 3)], torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"got a torch\.bfloat16 pool for torch\.float32 queries"):
        run(kernels, dataclasses.replace(case, pool=case.pool.bfloat16()))


def test_refuses_a_tree_wider_than_its_ancestor_bits(kernels: Kernels) -> None:
    parents = (-1, *range(64))
    case = make_case([(0, len(parents))], torch.float32, seed=2, parents=parents)
    with pytest.raises(ValueError, match="at most 64 rows"):
        run(kernels, case)


def test_tiles_must_be_powers_of_two_of_at_least_16() -> None:
    with pytest.raises(ValueError, match="key_tokens must be a power of two >= 16, got 24"):
        TritonTiles(key_tokens=24)


def test_auto_picks_cuda_triton_on_cuda_unless_flash_attn_suits_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = torch.device("cuda")
    assert auto_backend(torch.device("cpu"), 256) == "cpu"
    assert auto_backend(cuda, None) == "cuda-triton"
    installed = {"flash_attn": True}
    monkeypatch.setattr(
        registry.importlib.util, "find_spec", lambda name: object() if installed[name] else None
    )
    assert auto_backend(cuda, 512) == "flash_attn"
    assert auto_backend(cuda, 16) == "cuda-triton"  # flash-attn would refuse 16
    installed["flash_attn"] = False
    assert auto_backend(cuda, 512) == "cuda-triton"


def test_flash_attn_refuses_blocks_it_cannot_read_in_place() -> None:
    backend = FlashAttnBackend(lambda *args, **kwargs: None)
    case = make_case([(3, 2)], torch.float32, seed=4)
    meta = backend.build_metadata(
        layout_chunks(case.chunks, BLOCK_SIZE), BLOCK_SIZE, NUM_LAYERS, torch.device("cpu")
    )
    k, v = case.new_kv()
    with pytest.raises(ValueError, match=r"multiples of 256 \(256, 512, ...\), got 4"):
        backend.forward(LAYER, case.q, k, v, case.pool, meta)


def test_the_engine_model_gives_the_cpu_backend_logits(kernels: Kernels) -> None:
    """A random tiny Llama through the engine's model code (norms, RoPE, layers), two steps:
    a prefill, then a decode token beside a chunk after a cached prefix; the logits match
    those of the CPU backend."""
    model = tiny_model(seed=11)
    on_device = copy.deepcopy(model).to(kernels.device)  # on a GPU: Triton RMSNorm and RoPE
    runs = {"triton": (on_device, kernels.tiled()), "cpu": (model, get_backend("cpu-grouped"))}
    steps = [
        [ScheduledChunk("a", (5, 9, 2, 31, 7, 7, 40, 3, 1), 0, (3, 0, 5), sample=True)],
        [
            ScheduledChunk("a", (12,), 9, (3, 0, 5), sample=True),
            ScheduledChunk("b", (8, 8, 21, 4, 17), 6, (1, 6, 2, 7), sample=True),
        ],
    ]
    logits = {}
    for name, (step_model, backend) in runs.items():
        pool = allocate_kv_cache(TINY, num_blocks=8, block_size=4)
        pool[1:3] = torch.randn(pool[1:3].shape, generator=torch.Generator().manual_seed(0))
        pool = pool.to(step_model.embed_tokens.weight.device)
        logits[name] = [_step_logits(step_model, backend, step, pool).cpu() for step in steps]
    for got, expected in zip(logits["triton"], logits["cpu"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _step_logits(
    model: LlamaModel, backend: AttentionBackend, chunks: list[ScheduledChunk], pool: torch.Tensor
) -> torch.Tensor:
    layout = layout_chunks(chunks, 4)
    attn = backend.build_metadata(layout, 4, TINY.num_layers, pool.device)
    ids = torch.tensor([t for c in chunks for t in c.token_ids], device=pool.device)
    positions = torch.tensor(token_positions(layout), device=pool.device)
    with torch.inference_mode():
        hidden = model(ids, positions, attn, pool)
        return model.compute_logits(hidden)
