"""Bad input to the engine raises ValueError saying what to do; other requests are unharmed."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker_state import LoadedModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LLM:
    loaded = LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")
    return LLM(loaded=loaded, max_model_len=256, num_blocks=64)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt is empty"),
        (list(range(300)), GREEDY, r"exceeds the context length 256"),
        ([1, 2, 3], SamplingParams(max_tokens=254), r"exceeds the context length 256"),
        ([1, 49152], GREEDY, r"prompt token ids must be in \[0, 49152\)"),
    ],
)
def test_bad_request_is_refused_and_engine_keeps_serving(
    llm: LLM, prompt: list[int], params: SamplingParams, message: str
) -> None:
    engine = llm.engine
    engine.add_request("good", [504, 3575, 282, 4649, 314], GREEDY)
    engine.step()  # the good request is mid-flight when the bad one arrives
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == "good" for t in out.token_ids]
    assert len(tokens) == GREEDY.max_tokens - 1  # the first came from the step above
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_duplicate_request_id_is_refused(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", [4, 5, 6], GREEDY)
    assert engine.abort("dup")
    assert not engine.has_unfinished()


def test_stop_string_ends_the_text_before_it(llm: LLM) -> None:
    free = llm.generate(["The capital of France is"], GREEDY)[0]
    assert "Paris" in free.text
    stopped = llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=8, stop=("Paris",)),
    )[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("Paris")]


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=3)
    first = llm.generate(["Once upon a time"], params)[0]
    again = llm.generate(["Once upon a time"], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
