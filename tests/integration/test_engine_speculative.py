"""Speculation changes no output: seeded sampling, logprobs, stop strings and the per-request
opt-out give what decoding without it gives (greedy equality with transformers, preemption
and the prefill->decode hand-off are in test_engine_greedy.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker_state import LoadedModel

TEXT = (
    "The committee met on Tuesday to review the budget. It approved the new library, "
    "postponed the bridge repairs until spring, and asked the treasurer for a report on "
    "the water rates before the next meeting."
)
PROMPTS = [
    f"<|im_start|>user\nRepeat this text exactly:\n{TEXT}<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\nCorrect the spelling: {TEXT.replace('the', 'teh')}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def loaded(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LoadedModel:
    return LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")


def generate(loaded: LoadedModel, params: list[SamplingParams], **config: Any) -> tuple[list, LLM]:
    llm = LLM(loaded=loaded, **config)
    return [r.outputs[0] for r in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_gives_the_same_tokens_with_speculation(
    loaded: LoadedModel, method: str
) -> None:
    """A seeded draw depends on the seed and the output length only, and verification draws
    each token exactly as decoding would: so the tokens are the same, not just distributed
    the same (the distribution itself: tests/unit/test_speculative_verify.py)."""
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=11 + i, max_tokens=48)
        for i in range(len(PROMPTS))
    ]
    plain, _ = generate(loaded, params)
    spec, llm = generate(loaded, params, speculative=method, draft_model="smollm2-135m-instruct")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.stats.accepted_tokens > 0


def test_logprobs_and_penalties_are_those_of_decoding(loaded: LoadedModel) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, repetition_penalty=1.1)
    ] * len(PROMPTS)
    plain, _ = generate(loaded, params)
    spec, llm = generate(loaded, params, speculative="ngram")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for ours, ref in zip(spec, plain, strict=True):
        assert len(ours.logprobs) == len(ours.token_ids)
        for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert llm.engine.speculator is not None and llm.engine.speculator.stats.verify_steps > 0


def test_a_stop_string_inside_a_step_ends_the_output_where_decoding_would(
    loaded: LoadedModel,
) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, stop=("bridge",)),
        SamplingParams(temperature=0.0, max_tokens=60, stop=("library",)),
        SamplingParams(temperature=0.0, max_tokens=60, stop=("sea",)),
    ]
    plain, _ = generate(loaded, params)
    spec, _ = generate(loaded, params, speculative="ngram")
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == [
        (o.token_ids, o.text, o.finish_reason) for o in plain
    ]
    assert plain[0].finish_reason == "stop"


def test_a_request_can_opt_out(loaded: LoadedModel) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    opted_out = dataclasses.replace(greedy, speculative=False)
    llm = LLM(loaded=loaded, speculative="ngram")
    (out,) = llm.generate(PROMPTS[:1], opted_out)
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.stats.verify_steps == 0
    (again,) = llm.generate(PROMPTS[:1], greedy)
    assert speculator.stats.verify_steps > 0
    assert again.token_ids == out.token_ids
