"""OpenAI-compatible request and response bodies; their JSON Schema is the API's contract.

Constraints are written into the fields (not checked later by hand) so the OpenAPI schema
tells clients exactly what is accepted. Unknown fields are ignored, as OpenAI's API does.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict

from pdserve.router.policies import POLICY_NAMES

U32 = 2**32 - 1
JSON_SAFE_INT = 2**53 - 1  # larger integers do not survive JSON parsers that use doubles


def _json_integer(value: object) -> object:
    # JSON Schema counts 2.0 as an integer, so bodies are strict except that integer fields
    # take floats without a fraction; booleans and strings stay invalid.
    if isinstance(value, bool | str):
        raise ValueError("Input should be a valid integer")
    return value


def _not_echo(value: bool) -> bool:
    if value:
        raise ValueError("echo is not supported: send false or leave it out")
    return value


# Integer types: bounds first (so the JSON Schema shows them), then the JSON-integer check.
_LAX = Strict(False)
_JSON_INT = BeforeValidator(_json_integer)
TokenId = Annotated[int, _LAX, Field(ge=0, le=U32), _JSON_INT]
PositiveInt = Annotated[int, _LAX, Field(ge=1), _JSON_INT]
Seed = Annotated[int, _LAX, Field(ge=0, le=JSON_SAFE_INT), _JSON_INT]
LogprobCount = Annotated[int, _LAX, Field(ge=0, le=20), _JSON_INT]
TopK = Annotated[int, _LAX, Field(ge=0, le=2**31 - 1), _JSON_INT]
ChoiceCount = Annotated[int, _LAX, Field(ge=1, le=16), _JSON_INT]
StopString = Annotated[str, Field(min_length=1)]
RoutingPolicyName = Literal["round_robin", "least_loaded", "prefix_aware", "joint_ttft"]
assert set(get_args(RoutingPolicyName)) == set(POLICY_NAMES), "policy names out of sync"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str = Field(description="A model id from /v1/models.")
    max_tokens: PositiveInt | None = Field(default=None, description="Default: 16.")
    temperature: Annotated[float, Field(ge=0, le=100)] | None = Field(
        default=None, description="0 = greedy."
    )
    # Lower bounds of 1e-6 rather than "> 0": workers receive float32, where a tiny positive
    # value becomes 0 and is then invalid.
    top_p: Annotated[float, Field(ge=1e-6, le=1)] | None = None
    n: ChoiceCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    seed: Seed | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # Extensions beyond OpenAI's API (vLLM uses the same names).
    top_k: TopK = Field(default=0, description="0 disables.")
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, ge=1e-6, le=100)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] = []
    include_stop_str_in_output: bool = False
    # pdserve's own extension.
    speculative: bool = Field(
        default=True,
        description="false: never speculate for this request (the output is the same).",
    )
    routing_policy: RoutingPolicyName | None = Field(
        default=None, description="Overrides the x-pdserve-routing-policy header."
    )


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)
        ]
    ) = Field(description="Text or token ids; a batch of prompts must hold exactly one.")
    logprobs: LogprobCount | None = None
    echo: Annotated[bool, AfterValidator(_not_echo)] = Field(
        default=False,
        description="Echoing the prompt is not supported: false only.",
        json_schema_extra={"enum": [False]},
    )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = Field(
        default=None, description="Wins over max_tokens."
    )
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionStreamChunk(BaseModel):
    """One ``data:`` event of a streamed completion (the usage event has no choices)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatStreamChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion (the usage event has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "no_workers"]
    workers: int
