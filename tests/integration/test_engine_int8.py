"""An int8 KV pool (``kv_cache_dtype="int8"``) in the engine, on the real model.

* Greedy output agrees with the bf16 pool's (bf16 weights) for a number of leading tokens
  chosen from measurement: on these prompts (test_engine_greedy's), 64 tokens each, the int8
  pool kept 26, 64, 5, 5, 21, 64, 64, 64 tokens before the first difference (61% in all;
  Zen 4, 2026-11-27). For scale: the bf16 pool against the fp32 one, 64, 53, 5, 5, 31, 17,
  64, 64 (59%): prompts 2 and 3 meet near-ties early either way. The bounds: every prompt
  keeps 4 tokens, all prompts half their tokens.
* Every engine technique (prefix caching, chunked prefill, preemption, batch size,
  speculative decoding, the prefill -> decode hand-off through kv_transfer) changes no token
  of the int8 pool's own greedy output: each reads and moves the same int8 rows. With fp32
  weights, as test_engine_greedy's fp32 pool (bf16 arithmetic is not chunk-invariant: a bf16
  pool's chunk-16 prefill changes prompt 6 after 35 tokens, an int8 pool's after 62).
* The runner moves a speculative token's K/V with its scales.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.bench.int8_effect import KVMover
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.loader import load_model
from pdserve.engine.runner import ModelRunner, allocate_kv_cache, bytes_per_block
from pdserve.engine.worker_state import LoadedModel
from tests.integration.test_engine_greedy import DRAFT, PROMPTS, _drain

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # the settings tests
MIN_LEADING_TOKENS = 4  # per prompt
MIN_LEADING_SHARE = 0.5  # of all tokens


@pytest.fixture(scope="module")
def loaded_bf16(default_model_source: Any, smollm2_tokenizer: Any) -> LoadedModel:
    weights = load_model(default_model_source, dtype=torch.bfloat16, show_progress=False)
    return LoadedModel(default_model_source, weights, smollm2_tokenizer, "bfloat16")


@pytest.fixture(scope="module")
def loaded(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LoadedModel:
    return LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: Any) -> list[list[int]]:
    return [smollm2_tokenizer.encode(p) for p in PROMPTS]


def run(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams = SHORT,
    **config: Any,
) -> tuple[list[list[int]], LLM]:
    llm = LLM(loaded=loaded, dtype=loaded.dtype, **config)
    return [r.token_ids for r in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module")
def int8_greedy(loaded: LoadedModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The int8 pool's greedy tokens (fp32 weights), the settings tests' reference."""
    return run(loaded, prompt_ids, kv_cache_dtype="int8")[0]


def leading_agreement(ours: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, the tokens in common before the first difference."""
    return [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(ours, reference, strict=True)
    ]


def test_int8_pool_agrees_with_the_bf16_pool_for_the_leading_tokens(
    loaded_bf16: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    bf16_greedy, llm = run(loaded_bf16, prompt_ids, GREEDY)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    int8_greedy, llm = run(loaded_bf16, prompt_ids, GREEDY, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_cache.dtype == torch.int8
    leading = leading_agreement(int8_greedy, bf16_greedy)
    print(f"int8 vs bf16 pool, tokens before the first difference: {leading}")
    assert min(leading) >= MIN_LEADING_TOKENS, leading
    assert sum(leading) >= MIN_LEADING_SHARE * NEW_TOKENS * len(leading), leading


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"enable_prefix_caching": False}, id="prefix-cache-off"),
        pytest.param({"enable_chunked_prefill": False}, id="chunking-off"),
        pytest.param({"long_prefill_token_threshold": 16}, id="chunk-16"),
        pytest.param({"max_num_seqs": 1}, id="batch-1"),
        pytest.param({"speculative": "ngram"}, id="speculative-ngram"),
        pytest.param({"speculative": "draft", "draft_model": DRAFT}, id="speculative-draft"),
    ],
)
def test_engine_settings_change_no_token_of_the_int8_pool(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    int8_greedy: list[list[int]],
    config: dict[str, Any],
) -> None:
    tokens, llm = run(loaded, prompt_ids, kv_cache_dtype="int8", **config)
    assert tokens == int8_greedy
    if llm.engine.speculator is not None:
        assert llm.engine.speculator.stats.accepted_tokens > 0


def test_preemption_and_shared_prefixes_change_no_token_of_the_int8_pool(
    loaded: LoadedModel, prompt_ids: list[list[int]], int8_greedy: list[list[int]]
) -> None:
    """56 blocks x 16 = 896 token slots for ~1.3k tokens of demand: sequences are evicted
    and recomputed; then every prompt four times at once shares its blocks."""
    tokens, llm = run(loaded, prompt_ids, kv_cache_dtype="int8", num_blocks=56)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert tokens == int8_greedy
    tokens, llm = run(loaded, prompt_ids * 4, kv_cache_dtype="int8")
    assert llm.engine.scheduler.stats().prefix_hit_tokens > 0
    assert tokens == int8_greedy * 4


@pytest.mark.parametrize("prefill_pool", ["int8", "auto"], ids=["from-int8", "from-fp32"])
def test_prefill_then_decode_into_an_int8_pool(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    int8_greedy: list[list[int]],
    prefill_pool: str,
) -> None:
    """The prompt's KV moves from a prefill engine's pool to a decode engine's int8 pool
    through kv_transfer (in-process), as int8: as stored from an int8 pool, and the decode
    goes on exactly as in one int8 engine; quantized by the sender from an fp32 pool (whose
    prefill attended unquantized K/V), within the bound above."""
    outputs = handoff_greedy(loaded, prompt_ids, prefill_pool)
    if prefill_pool == "int8":
        assert outputs == int8_greedy
        return
    leading = leading_agreement(outputs, int8_greedy)
    assert min(leading) >= MIN_LEADING_TOKENS, leading
    assert sum(leading) >= MIN_LEADING_SHARE * SHORT.max_tokens * len(leading), leading


def handoff_greedy(
    loaded: LoadedModel,
    prompts: list[list[int]],
    prefill_pool: str,
    params: SamplingParams = SHORT,
) -> list[list[int]]:
    """Greedy tokens of each prompt prefilled by an engine with a ``prefill_pool`` pool and
    decoded by one with an int8 pool, the KV moved between them through kv_transfer's
    in-process backend (each block as int8: checked)."""
    prefill = LLM(loaded=loaded, dtype=loaded.dtype, kv_cache_dtype=prefill_pool).engine
    decode = LLM(loaded=loaded, dtype=loaded.dtype, kv_cache_dtype="int8").engine
    mover = KVMover(prefill.runner.kv_cache, decode.runner.kv_cache)
    int8_block_bytes = bytes_per_block(decode.model_config, 16, torch.int8)
    outputs = []
    try:
        for i, ids in enumerate(prompts):
            rid = f"r{i}"
            prefill.add_prefill_request(rid, ids, params)
            first = [o for o in _drain(prefill) if o.request_id == rid]
            reservation = decode.reserve_import(rid, ids)
            assert reservation is not None
            src = prefill.block_table(rid)
            moved = mover.move(src, reservation.block_ids, int8=False)
            assert moved == len(src) * int8_block_bytes
            prefill.release(rid)
            assert decode.admit_imported(rid, ids, params, first[0].token_ids[0])
            rest = [t for o in _drain(decode) if o.request_id == rid for t in o.token_ids]
            outputs.append([first[0].token_ids[0], *rest])
    finally:
        mover.close()
    return outputs


def test_moved_slots_take_their_scales(smollm2_model: Any) -> None:
    """An accepted speculative token's K/V moves from its tree slot to its position's slot:
    in an int8 pool the whole rows, values and the scales after them."""
    config = smollm2_model.config
    pool = allocate_kv_cache(config, 4, 16, torch.int8)
    pool.copy_(torch.randint(-127, 128, pool.shape, dtype=torch.int8))
    before = pool.clone()
    runner = ModelRunner(config, smollm2_model, pool, 16)
    runner.move_slots([(20, 5), (21, 6), (63, 17)])
    for src, dst in [(20, 5), (21, 6), (63, 17)]:
        assert torch.equal(pool[dst // 16, :, :, dst % 16], before[src // 16, :, :, src % 16])
    moved = torch.zeros(pool.shape[:4], dtype=torch.bool)
    for dst in (5, 6, 17):
        moved[dst // 16, :, :, dst % 16] = True
    assert torch.equal(pool[~moved], before[~moved])
