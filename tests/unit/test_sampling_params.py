import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.model.registry import resolve_model
from pdserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -5}, "max_tokens must be >= 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be finite"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 2.0}, "min_p must be in [0, 1]"),
        ({"n": 0}, "n must be in [1, 16]"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params_name_the_field_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_unknown_model_lists_the_known_names_and_path_forms() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(ValueError, match="unknown engine option 'blocksize'"):
        EngineConfig.from_kwargs(blocksize=16)


def test_options_reach_the_component_that_owns_them() -> None:
    config = EngineConfig.from_kwargs(block_size=8, max_num_seqs=4, dtype="bfloat16")
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.dtype) == (
        8,
        4,
        "bfloat16",
    )


def test_from_fields_fills_what_the_caller_left_unset() -> None:
    assert SamplingParams.from_fields({}) == SamplingParams()
    params = SamplingParams.from_fields({"temperature": 0.0, "stop": ["a", "b"], "seed": 0})
    assert params == SamplingParams(temperature=0.0, stop=("a", "b"), seed=0)
    assert isinstance(params.stop, tuple)


def test_from_fields_default_max_tokens_applies_only_when_unset() -> None:
    assert SamplingParams.from_fields({}, default_max_tokens=9).max_tokens == 9
    assert SamplingParams.from_fields({"max_tokens": 3}, default_max_tokens=9).max_tokens == 3


def test_from_fields_names_unknown_fields_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['best_of'\]"):
        SamplingParams.from_fields({"best_of": 2, "n": 1})
    with pytest.raises(ValueError, match="stop must be a sequence, got str"):
        SamplingParams.from_fields({"stop": "abc"})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_fields({"top_p": 0.0})
