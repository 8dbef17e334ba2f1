"""Request validation at the edge and protobuf conversion, with a FAKE tokenizer."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2
from pdserve.proto.params import params_from_proto, params_to_proto
from pdserve.router.config import RouterConfig
from pdserve.router.edge.convert import chunk_from_proto, chunk_to_proto
from pdserve.router.edge.errors import InvalidRequestError
from pdserve.router.edge.frontend import Frontend
from pdserve.router.request.types import ChunkEvent, TokenLogprob


class FakeTokenizer:
    """A FAKE: one token per character. Not a real model's tokenizer."""

    eos_token_id = 0
    vocab_size = 1000
    max_context_tokens = 32
    model_id = "fake"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def frontend(**config: object) -> Frontend:
    return Frontend(RouterConfig(**config), FakeTokenizer(), lifecycle=None)  # type: ignore[arg-type]


def test_unknown_model_is_rejected_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="'gpt-9' is not served here") as caught:
        frontend().resolve_model("gpt-9")
    assert caught.value.param == "model"
    assert frontend().resolve_model("") == "fake"
    assert frontend(served_model_names=("a", "b")).resolve_model("b") == "b"


def test_prompt_limits() -> None:
    fe = frontend()
    assert fe.check_prompt([1] * 31) == (1,) * 31
    with pytest.raises(InvalidRequestError, match="32 tokens, at most 31"):
        fe.check_prompt([1] * 32)
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        fe.check_prompt([])
    with pytest.raises(InvalidRequestError, match=r"prompt\[1\] = 1000 is not a token id"):
        fe.check_prompt([5, 1000])


def test_max_tokens_default_and_limits() -> None:
    fe = frontend(default_max_tokens=16, max_tokens_limit=20)
    assert fe.max_tokens_for(None, prompt_tokens=4) == 16
    assert fe.max_tokens_for(None, prompt_tokens=30) == 2  # only 2 positions left
    assert fe.max_tokens_for(20, prompt_tokens=4) == 20
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be in \[1, 20\].*got 21"):
        fe.max_tokens_for(21, prompt_tokens=4)
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be in \[1, 2\]"):
        fe.max_tokens_for(3, prompt_tokens=30)


def test_unknown_routing_policy_is_rejected() -> None:
    params = SamplingParams()
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        frontend().build("fake", (1, 2), params, routing_policy="nearest")
    assert frontend().build("fake", (1,), params, "Prefix-Aware").routing_policy == "prefix_aware"


def test_prior_output_tokens_must_leave_a_prompt() -> None:
    resumed = SamplingParams(prior_output_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"prior_output_tokens \(2\) must be fewer"):
        frontend().build("fake", (1, 2), resumed)
    assert frontend().build("fake", (1, 2, 3), resumed).params.prior_output_tokens == 2


def test_sampling_params_survive_the_protobuf_round_trip() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        seed=2**63,
        stop=("x",),
        stop_token_ids=(3,),
        logprobs=2,
        n=3,
        ignore_eos=True,
        prior_output_tokens=4,
    )
    assert params_from_proto(params_to_proto(params), default_max_tokens=16) == params


def test_unset_protobuf_fields_take_engine_defaults() -> None:
    params = params_from_proto(common_pb2.SamplingParams(), default_max_tokens=9)
    assert params == SamplingParams(max_tokens=9)
    with pytest.raises(ValueError, match="top_p must be in"):
        params_from_proto(common_pb2.SamplingParams(top_p=0.0), default_max_tokens=9)


def test_chunks_survive_the_protobuf_round_trip() -> None:
    chunk = ChunkEvent(
        index=1,
        token_ids=(4, 5),
        text="ab",
        logprobs=(TokenLogprob(4, -0.5, ((4, -0.5), (9, -2.0))),),
        finish_reason="stop",
    )
    assert chunk_from_proto(chunk_to_proto(chunk)) == chunk
    assert chunk_from_proto(common_pb2.TokenChunk(text="a")).finish_reason is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"repetition_penalty": 1e300}, "repetition_penalty must be a finite float32"),
        ({"top_p": 1e-50}, r"top_p must be in \(0, 1\], got 0.0"),  # 0.0 once in float32
    ],
)
def test_params_are_checked_as_the_workers_will_see_them(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        frontend().sampling_params(fields, max_tokens=4, prompt_tokens=4)


def test_config_repr_never_shows_api_keys() -> None:
    config = RouterConfig(api_keys=("sk-very-secret",))
    assert "sk-very-secret" not in repr(config)
    with pytest.raises(ValueError, match="TLS needs both"):
        RouterConfig(tls_cert_path="cert.pem")
