"""What the engine hands back: per-step deltas for streaming, whole results for offline use."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True, frozen=True)
class StepOutput:
    """New tokens of one sequence (``index`` < n) produced by one engine step."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, step: StepOutput) -> None:
        self.token_ids.extend(step.token_ids)
        self.text += step.text
        self.logprobs.extend(step.logprobs)
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        """The first completion's text (the common n == 1 case)."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
