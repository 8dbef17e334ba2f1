"""What flows through the router: a validated request in, chunks and a summary out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class GenerateInput:
    """A validated, tokenized request. ``arrival_s`` is ``time.monotonic()`` at receipt."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_s: float
    routing_policy: str = ""  # "" = the router's default
    deadline_s: float = 0.0  # seconds after arrival; 0 = the router's default


@dataclass(slots=True, frozen=True)
class ChunkEvent:
    """New tokens of sequence ``index`` (< n); ``text`` is already detokenized by the worker.

    ``is_last`` marks the chunk that finishes the last running sequence of the request.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    is_last: bool = False


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True, frozen=True)
class RequestTiming:
    """Seconds from arrival; ``itl_s`` holds the gaps between consecutive chunks."""

    ttft_s: float
    e2e_s: float
    queue_s: float
    transfer_s: float = 0.0
    itl_s: tuple[float, ...] = field(default=(), repr=False)


@dataclass(slots=True, frozen=True)
class Summary:
    """The last event of every successful request."""

    request_id: str
    usage: Usage
    timing: RequestTiming
    prefill_worker: str
    decode_worker: str  # "" when colocated
    policy: str


class TimingSink(Protocol):
    """Where per-request timings go for SLO goodput (cluster/ plugs in its metrics store)."""

    def record(self, request_id: str, timing: RequestTiming) -> None: ...


class InMemoryTimingSink:
    """Keeps the last ``capacity`` timings; the default sink and the one tests read."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self.timings: list[tuple[str, RequestTiming]] = []

    def record(self, request_id: str, timing: RequestTiming) -> None:
        self.timings.append((request_id, timing))
        if len(self.timings) > 2 * self.capacity:
            del self.timings[: -self.capacity]

    def recent(self) -> Sequence[tuple[str, RequestTiming]]:
        return self.timings[-self.capacity :]
