"""Router chunks -> OpenAI completion / chat completion bodies, streamed or whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.edge.http_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprobInfo,
    TopLogprob,
    UsageInfo,
)
from pdserve.router.request.types import ChunkEvent, Summary, TokenLogprob

DecodeToken = Callable[[int], str]


@dataclass(slots=True)
class _Choice:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def usage_info(summary: Summary) -> UsageInfo:
    usage = summary.usage
    total = usage.prompt_tokens + usage.completion_tokens
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=total,
    )


class _Formatter:
    object_name = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        n: int,
        decode: DecodeToken,
        logprobs: bool,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.decode = decode
        self.want_logprobs = logprobs
        self.choices = [_Choice() for _ in range(n)]

    def add(self, chunk: ChunkEvent) -> None:
        """Accumulate a chunk for the whole (non-streamed) response."""
        choice = self.choices[chunk.index]
        choice.text += chunk.text
        choice.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            choice.finish_reason = chunk.finish_reason

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, summary: Summary) -> dict[str, Any]:
        body = self.envelope([])
        body["usage"] = usage_info(summary).model_dump()
        return body


class CompletionFormatter(_Formatter):
    object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets = [0] * len(self.choices)  # text offset of the next token, per choice

    def stream_chunk(self, chunk: ChunkEvent) -> dict[str, Any]:
        logprobs = self._logprobs(chunk.index, chunk.logprobs) if self.want_logprobs else None
        choice = {
            "index": chunk.index,
            "text": chunk.text,
            "logprobs": logprobs.model_dump() if logprobs is not None else None,
            "finish_reason": chunk.finish_reason,
        }
        return self.envelope([choice])

    def response(self, summary: Summary) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=self._logprobs(i, c.logprobs) if self.want_logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_info(summary),
        )

    def _logprobs(
        self, index: int, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]
    ) -> CompletionLogprobs:
        tokens = [self.decode(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{self.decode(t): p for t, p in lp.top} for lp in logprobs],
            text_offset=offsets,
        )


class ChatFormatter(_Formatter):
    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started = [False] * len(self.choices)

    def stream_chunk(self, chunk: ChunkEvent) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk.text}
        if not self._started[chunk.index]:
            self._started[chunk.index] = True
            delta["role"] = "assistant"
        logprobs = self._logprobs(chunk.logprobs) if self.want_logprobs else None
        choice = {
            "index": chunk.index,
            "delta": delta,
            "logprobs": logprobs.model_dump() if logprobs is not None else None,
            "finish_reason": chunk.finish_reason,
        }
        return self.envelope([choice])

    def response(self, summary: Summary) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(c.logprobs) if self.want_logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_info(summary),
        )

    def _logprobs(self, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[self._token_info(lp) for lp in logprobs])

    def _token_info(self, lp: TokenLogprob) -> TokenLogprobInfo:
        token = self.decode(lp.token_id)
        top = [self._top(t, p) for t, p in lp.top]
        return TokenLogprobInfo(
            token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
        )

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.decode(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
