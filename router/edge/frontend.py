"""What both edges (gRPC and HTTP) share: models, tokenization, limits, request building."""

from __future__ import annotations

import math
import struct
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.edge.errors import InvalidRequestError
from pdserve.router.edge.tokenizer import Tokenizer
from pdserve.router.policies import normalize_policy_name
from pdserve.router.request.lifecycle import RequestLifecycle
from pdserve.router.request.types import ChunkEvent, GenerateInput, Summary

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def as_sent_to_workers(params: SamplingParams) -> SamplingParams:
    """``params`` as the workers will see them (float32 on the wire), checked again.

    A value valid as a Python float can turn invalid in float32 (top_p 1e-50 -> 0.0, or
    1e300 -> inf); the client hears about it here rather than from a worker.
    """
    narrowed = {}
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
            raise InvalidRequestError(f"{name} must be a finite float32, got {value}", name)
        narrowed[name] = struct.unpack("f", struct.pack("f", value))[0]
    return replace(params, **narrowed)  # SamplingParams checks the narrowed values


_FLOAT32_MAX = 3.4028234663852886e38


class Frontend:
    """Turns a client's prompt and options into a validated ``GenerateInput`` and serves it."""

    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer, lifecycle: RequestLifecycle
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.lifecycle = lifecycle
        self.model_ids = config.served_model_names or (tokenizer.model_id,)
        self.max_context_tokens = tokenizer.max_context_tokens
        self.vocab_size: int | None = getattr(tokenizer, "vocab_size", None)

    def resolve_model(self, model: str) -> str:
        """The served model a request names; "" means the first (default) one."""
        if not model:
            return self.model_ids[0]
        if model not in self.model_ids:
            raise InvalidRequestError(
                f"model {model!r} is not served here; available: {list(self.model_ids)}",
                param="model",
                code="model_not_found",
            )
        return model

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, str]], param: str = "messages") -> list[int]:
        if not messages:
            raise InvalidRequestError(f"{param} must hold at least one message", param=param)
        return self.tokenizer.apply_chat_template(messages)

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> tuple[int, ...]:
        """The prompt as a tuple; ValueError when empty, too long or out of the vocabulary."""
        if not token_ids:
            raise InvalidRequestError(f"{param} must not be empty (0 tokens)", param=param)
        limit = self.max_context_tokens - 1  # leave room for one generated token
        if len(token_ids) > limit:
            raise InvalidRequestError(
                f"{param} is too long: {len(token_ids)} tokens, at most {limit} fit the "
                f"model's {self.max_context_tokens}-token context with one generated token",
                param=param,
                code="context_length_exceeded",
            )
        if self.vocab_size is not None:
            self._check_vocab(token_ids, param)
        return tuple(token_ids)

    def _check_vocab(self, token_ids: Sequence[int], param: str) -> None:
        vocab = self.vocab_size
        assert vocab is not None
        if min(token_ids) >= 0 and max(token_ids) < vocab:
            return  # the usual case, checked at C speed; the loop below finds the culprit
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab:
                raise InvalidRequestError(
                    f"{param}[{i}] = {token_id} is not a token id: must be in [0, {vocab})",
                    param=param,
                )

    def max_tokens_for(self, requested: int | None, prompt_tokens: int) -> int:
        """The request's max_tokens: the default when unset, checked against the context."""
        room = self.max_context_tokens - prompt_tokens
        upper = min(self.config.max_tokens_limit, room)
        if requested is None:
            return max(1, min(self.config.default_max_tokens, upper))
        if not 1 <= requested <= upper:
            raise InvalidRequestError(
                f"max_tokens must be in [1, {upper}] for this {prompt_tokens}-token prompt "
                f"(context {self.max_context_tokens}, limit {self.config.max_tokens_limit}), "
                f"got {requested}",
                param="max_tokens",
            )
        return requested

    def check_max_tokens_limit(self, max_tokens: int) -> None:
        limit = self.config.max_tokens_limit
        if max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens must be <= {limit}, got {max_tokens}", param="max_tokens"
            )

    def sampling_params(
        self, fields: dict[str, Any], max_tokens: int | None, prompt_tokens: int
    ) -> SamplingParams:
        """``SamplingParams(**fields)`` with max_tokens resolved; ValueError names the field."""
        resolved = self.max_tokens_for(max_tokens, prompt_tokens)
        return as_sent_to_workers(SamplingParams(max_tokens=resolved, **fields))

    def build(
        self,
        model: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        routing_policy: str = "",
        deadline_s: float = 0.0,
        arrival_s: float | None = None,
        request_id: str | None = None,
    ) -> GenerateInput:
        if deadline_s < 0:
            raise InvalidRequestError(
                f"deadline_s must be >= 0 (0 = none), got {deadline_s}", param="deadline_s"
            )
        if params.prior_output_tokens >= len(prompt_token_ids):
            raise InvalidRequestError(
                f"prior_output_tokens ({params.prior_output_tokens}) must be fewer than the "
                f"prompt's {len(prompt_token_ids)} tokens",
                param="prior_output_tokens",
            )
        if routing_policy:
            routing_policy = normalize_policy_name(routing_policy)
        return GenerateInput(
            request_id=request_id or uuid.uuid4().hex,
            model=model,
            prompt_token_ids=prompt_token_ids,
            params=params,
            arrival_s=time.monotonic() if arrival_s is None else arrival_s,
            routing_policy=routing_policy,
            deadline_s=deadline_s,
        )

    def generate(self, inp: GenerateInput) -> AsyncGenerator[ChunkEvent | Summary, None]:
        return self.lifecycle.generate(inp)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
