"""Greedy output of the offline engine equals transformers' greedy generate, token for token,
and no engine technique (prefix caching, chunked prefill, preemption, batch size,
prefill->decode hand-off) changes a token."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine import StepRecord
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.packed_gemm import gemm_for
from pdserve.engine.worker_state import LoadedModel

NEW_TOKENS = 64
_LONG = " ".join(
    f"Section {i}: the river keeps flowing past the old mill while the town sleeps."
    for i in range(40)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I would like a cup of coffee.",
    "List three primary colors:",
    "The quick brown fox",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    _LONG,  # > 512 tokens: exercises every chunk size below
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
DRAFT = "smollm2-135m-instruct"  # the only model here: the default model as its own draft


@pytest.fixture(scope="module")
def loaded(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LoadedModel:
    return LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: Any, hf_smollm2_tokenizer: Any) -> list[list[int]]:
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    assert ids == [hf_smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[-1]) > 512, "the long prompt must exceed the largest chunk"
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding involved).

    An empty EOS list makes transformers keep taking the argmax past EOS, which is what
    ``ignore_eos`` does (``min_new_tokens`` would mask EOS instead and so change the argmax).
    """
    config = copy.deepcopy(hf_smollm2.generation_config)
    config.update(eos_token_id=[], do_sample=False, max_new_tokens=NEW_TOKENS)
    outputs = []
    for ids in prompt_ids:
        prompt = torch.tensor([ids])
        with torch.inference_mode():
            out = hf_smollm2.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                generation_config=config,
            )
        assert out.shape[1] == len(ids) + NEW_TOKENS
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def run(
    loaded: LoadedModel, prompts: list[list[int]], **config: Any
) -> tuple[list[list[int]], LLM]:
    llm = LLM(loaded=loaded, **config)
    results = llm.generate(prompts, GREEDY)
    assert [r.prompt_token_ids for r in results] == prompts
    return [r.token_ids for r in results], llm


def test_offline_engine_matches_transformers(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    tokens, _ = run(loaded, prompt_ids)
    for i, (ours, ref) in enumerate(zip(tokens, hf_greedy, strict=True)):
        assert ours == ref, f"prompt {i} diverges at token {_first_diff(ours, ref)}"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"enable_prefix_caching": False}, id="prefix-cache-off"),
        pytest.param({"enable_chunked_prefill": False}, id="chunking-off"),
        pytest.param({"long_prefill_token_threshold": 16}, id="chunk-16"),
        pytest.param({"long_prefill_token_threshold": 64}, id="chunk-64"),
        pytest.param({"long_prefill_token_threshold": 512}, id="chunk-512"),
        pytest.param({"max_num_seqs": 1}, id="batch-1"),
        pytest.param({"speculative": "ngram"}, id="speculative-ngram"),
        pytest.param({"speculative": "ngram", "max_num_seqs": 1}, id="speculative-ngram-batch-1"),
        pytest.param({"speculative": "draft", "draft_model": DRAFT}, id="speculative-draft"),
    ],
)
def test_engine_settings_never_change_a_token(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]], config: dict
) -> None:
    tokens, _ = run(loaded, prompt_ids, **config)
    assert tokens == hf_greedy


def test_batch_32_with_shared_prefixes_hits_the_cache(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    prompts = prompt_ids * 4
    tokens, llm = run(loaded, prompts)
    assert tokens == hf_greedy * 4
    assert llm.engine.scheduler.stats().prefix_hit_tokens > 0


def test_forced_preemption_recomputes_identically(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    # 56 blocks x 16 = 896 token slots for ~1.6k tokens of demand: sequences must be evicted.
    tokens, llm = run(loaded, prompt_ids, num_blocks=56)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert tokens == hf_greedy


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_forced_preemption_changes_no_token(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]], method: str
) -> None:
    tokens, llm = run(loaded, prompt_ids, num_blocks=56, speculative=method, draft_model=DRAFT)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.stats.accepted_tokens > 0
    assert tokens == hf_greedy


def test_the_model_as_its_own_draft_accepts_every_candidate(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Same weights, greedy: the draft's first choice is the target's argmax at every depth.
    The second-choice branches are rejected by construction, so count the chains."""
    tokens, llm = run(loaded, prompt_ids, speculative="draft", draft_model=DRAFT)
    assert tokens == hf_greedy
    speculator = llm.engine.speculator
    assert speculator is not None
    stats = speculator.stats
    # Every verify step keeps its whole chain: the depth the policy gave it.
    assert stats.verify_steps > 0
    assert stats.accepted_tokens == stats.chain_tokens, (
        f"{stats.chain_tokens - stats.accepted_tokens} of {stats.chain_tokens} chain "
        "candidates rejected"
    )


def test_step_observer_sees_every_step_and_changes_no_token(
    loaded: LoadedModel, prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    llm = LLM(loaded=loaded)
    records: list[StepRecord] = []
    llm.engine.add_step_observer(records.append)
    results = llm.generate(prompt_ids, GREEDY)
    assert [r.token_ids for r in results] == hf_greedy
    # Each sampled row is one generated token: the observer saw every step that sampled.
    sampled_rows = sum(r.logits.shape[0] for r in records)
    assert sampled_rows == sum(len(t) for t in hf_greedy)
    assert all(r.step_s > 0 and not r.plan.is_empty for r in records)
    for record in records:
        assert record.logits.shape[0] == sum(c.sample for c in record.plan.chunks)


@pytest.mark.parametrize(
    "decode_config",
    [
        pytest.param({}, id="plain"),
        pytest.param({"speculative": "ngram"}, id="speculative-ngram"),
        pytest.param({"speculative": "draft", "draft_model": DRAFT}, id="speculative-draft"),
    ],
)
def test_prefill_then_decode_in_another_engine(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    hf_greedy: list[list[int]],
    decode_config: dict,
) -> None:
    """The role hooks: one engine prefills and keeps KV, its blocks are copied into another
    engine's reservation, which continues the sequence (what the workers do over NIXL), with
    or without speculation on the decode side."""
    prefill = LLM(loaded=loaded).engine
    decode = LLM(loaded=loaded, **decode_config).engine
    for i, ids in enumerate([prompt_ids[0], prompt_ids[2], prompt_ids[-1]]):
        rid = f"r{i}"
        prefill.add_prefill_request(rid, ids, GREEDY)
        first = [o for o in _drain(prefill) if o.request_id == rid]
        assert len(first) == 1 and first[0].finish_reason is None
        reservation = decode.reserve_import(rid, ids)
        assert reservation is not None
        src = prefill.block_table(rid)
        dst = reservation.block_ids
        decode.runner.kv_cache[list(dst)] = prefill.runner.kv_cache[list(src)]
        prefill.release(rid)
        assert decode.admit_imported(rid, ids, GREEDY, first[0].token_ids[0])
        rest = [t for o in _drain(decode) if o.request_id == rid for t in o.token_ids]
        assert [first[0].token_ids[0], *rest] == hf_greedy[[0, 2, -1][i]]
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    if decode.speculator is not None:
        assert decode.speculator.stats.accepted_tokens > 0


def _drain(engine: Any) -> list[Any]:
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.fixture(scope="module")
def loaded_bf16(default_model_source: Any, smollm2_tokenizer: Any) -> LoadedModel:
    weights = load_model(default_model_source, dtype=torch.bfloat16, show_progress=False)
    return LoadedModel(default_model_source, weights, smollm2_tokenizer, "bfloat16")


def test_bf16_greedy_is_the_same_alone_and_in_a_batch(
    loaded_bf16: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    """bf16 takes other kernels (our AMX or AVX-512 BF16 GEMM, the decode kernel's bf16
    loads, our prefill kernel's or, with AMX, torch's): each row and each sequence is still
    computed on its own, so the batch it runs in changes no token. On a CPU with neither AMX
    nor AVX-512 BF16 the linears are oneDNN's, with which (measured on a Zen 4) tokens did
    depend on the batch, so only the run itself is checked."""
    together, _ = run(loaded_bf16, prompt_ids, dtype="bfloat16")
    assert all(len(t) == NEW_TOKENS for t in together)
    if gemm_for(torch.bfloat16) is None:
        pytest.skip("no AMX or AVX-512 BF16 here: bf16 linears are oneDNN's, not batch-invariant")
    alone, _ = run(loaded_bf16, prompt_ids, dtype="bfloat16", max_num_seqs=1)
    assert together == alone
