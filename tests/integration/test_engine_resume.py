"""A request resumed from its delivered tokens (``prior_output_tokens``, what the router's
failover sends) gives the uninterrupted run's tokens: seeded draws continue from the output
count and presence/frequency penalties count the replayed output."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker_state import LoadedModel

PROMPT = "Once upon a time, in a small village by the sea,"
SAMPLED = SamplingParams(
    temperature=0.9, top_k=50, seed=7, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.5
)


@pytest.fixture(scope="module")
def llm(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LLM:
    loaded = LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")
    return LLM(loaded=loaded, num_blocks=64)


@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_request_continues_the_uninterrupted_one(llm: LLM, cut: int) -> None:
    prompt = llm.tokenizer.encode(PROMPT)
    whole = llm.generate([prompt], SAMPLED)[0].token_ids
    assert len(whole) == SAMPLED.max_tokens
    resumed = dataclasses.replace(SAMPLED, max_tokens=24 - cut, prior_output_tokens=cut)
    rest = llm.generate([prompt + whole[:cut]], resumed)[0].token_ids
    assert rest == whole[cut:]
    # Without it the replay would restart the draws (and forget the penalties).
    plain = dataclasses.replace(SAMPLED, max_tokens=24 - cut)
    assert llm.generate([prompt + whole[:cut]], plain)[0].token_ids != whole[cut:]


def test_prior_output_longer_than_the_prompt_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prior_output_tokens \\(5\\) must be fewer"):
        llm.generate([[1, 2, 3]], SamplingParams(prior_output_tokens=5))
    with pytest.raises(ValueError, match="prior_output_tokens must be >= 0"):
        SamplingParams(prior_output_tokens=-1)
