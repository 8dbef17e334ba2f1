"""What the benchmark records per request, and the recorder a streaming client fills in."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.bench.serve.datasets import BenchRequest
from pdserve.bench.serve.tokens import approx_tokens

ChatHistory = Sequence[tuple[str, str]]  # (role, content) messages before the user turn


@dataclass(slots=True, frozen=True)
class RequestOptions:
    """Sampling and identity fields every request carries."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """One request as the client saw it. Times in seconds; ``sent_at_s`` is on the
    ``time.perf_counter`` clock. ``ttft_s`` is nan when no token arrived."""

    success: bool
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: tuple[float, ...]
    e2e_s: float
    sent_at_s: float
    generated_text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2 or math.isnan(self.ttft_s):
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def finished_at_s(self) -> float:
        return self.sent_at_s + self.e2e_s


class BenchClient(Protocol):
    """A way to send one request and time its stream (OpenAI HTTP or gRPC)."""

    async def send(
        self, request: BenchRequest, history: ChatHistory | None = None
    ) -> RequestOutput:
        """Completion of ``request.prompt``; with ``history`` (even empty), a chat turn."""
        ...

    async def model_ids(self) -> list[str]: ...

    async def aclose(self) -> None: ...


def prompt_tokens_estimate(request: BenchRequest, history: ChatHistory | None) -> int:
    """Prompt length until the server's usage says better (chat templates add a few)."""
    earlier = sum(approx_tokens(content) for _, content in history or ())
    return request.prompt.num_tokens + earlier


class StreamRecorder:
    """Timestamps token events as they arrive; ``result()`` turns them into an output."""

    def __init__(self, prompt_tokens_estimate: int) -> None:
        self._start_s = time.perf_counter()
        self._token_times_s: list[float] = []
        self._tokens_seen = 0
        self._text: list[str] = []
        self._prompt_tokens = prompt_tokens_estimate
        self._usage_tokens: int | None = None
        self._error = ""

    def token(self, text: str, count: int = 1) -> None:
        """A stream event that carried ``count`` new tokens (and their text)."""
        self._token_times_s.append(time.perf_counter())
        self._tokens_seen += count
        self._text.append(text)

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        if prompt_tokens is not None:
            self._prompt_tokens = prompt_tokens
        if completion_tokens is not None:
            self._usage_tokens = completion_tokens

    def fail(self, message: str) -> None:
        self._error = self._error or message  # the first error is the cause

    def result(self) -> RequestOutput:
        end_s = time.perf_counter()
        times = self._token_times_s
        error = self._error or ("" if times else "the stream ended without any token")
        output_tokens = self._usage_tokens if self._usage_tokens is not None else self._tokens_seen
        return RequestOutput(
            success=not error,
            prompt_tokens=self._prompt_tokens,
            output_tokens=output_tokens,
            ttft_s=times[0] - self._start_s if times else math.nan,
            itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
            e2e_s=end_s - self._start_s,
            sent_at_s=self._start_s,
            generated_text="".join(self._text),
            error=error,
        )
