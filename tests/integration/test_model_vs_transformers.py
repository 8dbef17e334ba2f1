"""Our model vs transformers' LlamaForCausalLM on the same GGUF file: logits within 1e-3.

The prompt runs through the paged KV pool in one chunk and in chunks of 16 and 64 (several
sequences batched in one flat step, random block tables), then a few decode steps.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pdserve.engine.attention import get_backend, layout_chunks, token_positions
from pdserve.engine.runner import ModelRunner, allocate_kv_cache
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS, ATOL = 16, 160, 1e-3
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea. Waves fold into foam, and the tide keeps its own slow "
    "count of the hours while gulls argue over the pier and the light goes copper.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n# Explain what this function does and how to make it faster.\n"
    "It recomputes the same values many times; a loop or memoisation fixes that. " * 2,
)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: Any) -> list[list[int]]:
    return [smollm2_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_logits(
    hf_smollm2: Any, prompt_ids: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt + 4 greedy tokens, reference logits of every position) for each prompt."""
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            generated = hf_smollm2.generate(
                torch.tensor([ids]), max_new_tokens=4, do_sample=False, min_new_tokens=4
            )[0]
            out.append((generated, hf_smollm2(generated[None]).logits[0].float()))
    return out


def random_tables(lengths: list[int], seed: int) -> list[tuple[int, ...]]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    tables = []
    for n in lengths:
        needed = -(-n // BLOCK_SIZE)
        tables.append(tuple(blocks[:needed]))
        del blocks[:needed]
    return tables


def run_batched(
    runner: ModelRunner, seqs: list[list[int]], prompt_lens: list[int], chunk: int
) -> list[dict[int, torch.Tensor]]:
    """Prefill every prompt in chunks of ``chunk`` tokens, all sequences in the same steps,
    then decode the remaining tokens one per step; returns logits by position per sequence."""
    tables = random_tables([len(s) for s in seqs], seed=chunk)
    pos = [0] * len(seqs)
    logits: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
        chunks, owners = [], []
        for i, seq in enumerate(seqs):
            if pos[i] >= len(seq):
                continue
            step = min(chunk, prompt_lens[i] - pos[i]) if pos[i] < prompt_lens[i] else 1
            ids = tuple(seq[pos[i] : pos[i] + step])
            chunks.append(ScheduledChunk(str(i), ids, pos[i], tables[i], sample=True))
            owners.append(i)
            pos[i] += step
        out = runner.execute(BatchPlan(chunks=tuple(chunks)))
        for row, (i, c) in enumerate(zip(owners, chunks, strict=True)):
            logits[i][c.end_pos - 1] = out[row]
    return logits


@pytest.mark.parametrize(
    ("chunk", "backend"),
    [
        (10_000, "cpu"),
        (16, "cpu"),
        (64, "cpu"),
        (16, "cpu-grouped"),
        (16, "cpu-padded"),
        (16, "cpu-per-seq"),
    ],
)
def test_logits_match_transformers(
    smollm2_model: Any,
    prompt_ids: list[list[int]],
    hf_logits: list[tuple[torch.Tensor, torch.Tensor]],
    chunk: int,
    backend: str,
) -> None:
    config = smollm2_model.config
    cache = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE)
    runner = ModelRunner(config, smollm2_model, cache, BLOCK_SIZE, "cpu", get_backend(backend))
    seqs = [generated.tolist() for generated, _ in hf_logits]
    ours = run_batched(runner, seqs, [len(p) for p in prompt_ids], chunk)
    for seq_logits, (generated, reference) in zip(ours, hf_logits, strict=True):
        assert len(seq_logits) >= 5, "expected prefill ends plus four decode steps"
        for position, row in seq_logits.items():
            diff = (row - reference[position]).abs().max().item()
            assert diff <= ATOL, f"position {position} of {len(generated)}: max |diff| {diff}"


def test_every_prompt_position_matches_in_one_forward(
    smollm2_model: Any, prompt_ids: list[list[int]], hf_logits: list[Any]
) -> None:
    """All positions of a one-chunk prefill (not only the sampled one) match."""
    config = smollm2_model.config
    backend = get_backend("cpu")
    for ids, (_, reference) in zip(prompt_ids, hf_logits, strict=True):
        cache = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE)
        table = random_tables([len(ids)], seed=len(ids))[0]
        chunk = ScheduledChunk("s", tuple(ids), 0, table, sample=True)
        layout = layout_chunks([chunk], BLOCK_SIZE)
        attn = backend.build_metadata(layout, BLOCK_SIZE, config.num_layers, torch.device("cpu"))
        hidden = smollm2_model(
            torch.tensor(ids), torch.tensor(token_positions(layout)), attn, cache
        )
        logits = smollm2_model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        diff = (logits - reference[: len(ids)]).abs().max().item()
        assert diff <= ATOL, f"max |diff| over {len(ids)} positions: {diff}"
