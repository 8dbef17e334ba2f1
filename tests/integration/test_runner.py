"""ModelRunner on the real model: greedy decoding equals transformers' ``generate``, prefix
blocks shared between sequences, copy-on-write block copies, pool sizing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.engine.attention import get_backend
from pdserve.engine.runner import ModelRunner, allocate_kv_cache, bytes_per_block
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS, NEW_TOKENS = 16, 96, 12
CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colours."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
)


class GreedyDriver:
    """A minimal stand-in for the scheduler: bump-allocated blocks, prefill in chunks of 32,
    then one decode token per sequence per step, all sequences in the same steps."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], eos: int | None) -> None:
        self.runner, self.eos = runner, eos
        self.tokens = [list(p) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]
        self.done_pos = [0] * len(prompts)
        self.finished = [False] * len(prompts)
        per_seq = -(-(max(self.prompt_lens) + NEW_TOKENS) // BLOCK_SIZE)
        self.tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]

    def run(self) -> list[list[int]]:
        while not all(self.finished):
            chunks = [self._chunk(i) for i in range(len(self.tokens)) if not self.finished[i]]
            logits = self.runner.execute(BatchPlan(chunks=tuple(chunks)))
            sampled = [c for c in chunks if c.sample]
            assert logits.shape == (len(sampled), self.runner.config.vocab_size)
            for chunk, row in zip(sampled, logits, strict=True):
                self._append(int(chunk.seq_id), int(row.argmax()))
        return [t[n:] for t, n in zip(self.tokens, self.prompt_lens, strict=True)]

    def _chunk(self, i: int) -> ScheduledChunk:
        start = self.done_pos[i]
        end = min(start + 32, len(self.tokens[i]))
        self.done_pos[i] = end
        ids = tuple(self.tokens[i][start:end])
        return ScheduledChunk(str(i), ids, start, self.tables[i], end == len(self.tokens[i]))

    def _append(self, i: int, token: int) -> None:
        self.tokens[i].append(token)
        generated = len(self.tokens[i]) - self.prompt_lens[i]
        self.finished[i] = token == self.eos or generated >= NEW_TOKENS


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer: Any, hf_smollm2_tokenizer: Any) -> list[list[int]]:
    prompts = [smollm2_tokenizer.apply_chat_template(chat) for chat in CHATS]
    for ours, chat in zip(prompts, CHATS, strict=True):
        reference = hf_smollm2_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True
        )
        assert ours == list(reference["input_ids"]), "prompt token ids differ"
    return prompts


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2: Any, chat_prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in chat_prompts:
            generated = hf_smollm2.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0]
            outs.append(generated[len(ids) :].tolist())
    return outs


@pytest.mark.parametrize("backend", ["cpu", "cpu-padded", "cpu-per-seq"])
def test_greedy_matches_transformers_generate(
    smollm2_model: Any,
    smollm2_tokenizer: Any,
    chat_prompts: list[list[int]],
    hf_greedy: list[list[int]],
    backend: str,
) -> None:
    config = smollm2_model.config
    cache = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE)
    runner = ModelRunner(config, smollm2_model, cache, BLOCK_SIZE, "cpu", get_backend(backend))
    ours = GreedyDriver(runner, chat_prompts, smollm2_tokenizer.eos_token_id).run()
    assert ours == hf_greedy
    assert any(len(t) == NEW_TOKENS for t in ours), "nothing decoded past the prompt"


def test_shared_prefix_blocks_give_the_same_logits(
    smollm2_model: Any, chat_prompts: list[list[int]]
) -> None:
    """Sequence B reuses A's first full blocks (as prefix caching does) and starts there."""
    config = smollm2_model.config
    runner = ModelRunner(config, smollm2_model, allocate_kv_cache(config, 32, BLOCK_SIZE), 16)
    prompt = [t for p in chat_prompts for t in p]  # long enough for 2+ full blocks
    shared = (len(prompt) // BLOCK_SIZE - 1) * BLOCK_SIZE
    table_a = tuple(range(10))
    table_b = table_a[: shared // BLOCK_SIZE] + tuple(range(20, 30))
    full = runner.execute(BatchPlan((ScheduledChunk("a", tuple(prompt), 0, table_a, True),)))
    tail = ScheduledChunk("b", tuple(prompt[shared:]), shared, table_b, True)
    assert shared >= BLOCK_SIZE, f"prompt of {len(prompt)} tokens shares no full block"
    reused = runner.execute(BatchPlan((tail,)))
    torch.testing.assert_close(reused, full, atol=1e-4, rtol=0)


def test_block_copies_copy_whole_blocks_before_the_forward(smollm2_model: Any) -> None:
    config = smollm2_model.config
    cache = torch.randn(8, config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    before = cache.clone()
    runner = ModelRunner(config, smollm2_model, cache, BLOCK_SIZE)
    logits = runner.execute(BatchPlan(block_copies=((1, 5), (3, 2))))
    assert logits.shape == (0, config.vocab_size)
    assert torch.equal(cache[5], before[1]) and torch.equal(cache[2], before[3])
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(cache[untouched], before[untouched])


def test_kv_cache_sizing_and_shape_check(smollm2_model: Any) -> None:
    config = smollm2_model.config
    for dtype, row in ((torch.float32, 64), (torch.bfloat16, 64), (torch.int8, 64 + 2)):
        cache = allocate_kv_cache(config, 4, BLOCK_SIZE, dtype)
        assert cache.shape == (4, 30, 2, BLOCK_SIZE, 3, row)
        one_block = cache[0]
        assert one_block.is_contiguous(), "a block must be one contiguous byte range"
        assert bytes_per_block(config, BLOCK_SIZE, dtype) == one_block.numel() * dtype.itemsize
    with pytest.raises(ValueError, match="block_size 32"):
        ModelRunner(config, smollm2_model, allocate_kv_cache(config, 4, BLOCK_SIZE), 32)
