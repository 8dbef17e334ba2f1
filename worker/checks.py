"""What every worker role checks at its gRPC edge before the engine sees a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_REQUEST_ID_CHARS = 200


def check_request_id(request_id: str) -> str:
    """``request_id`` if it is 1..200 printable characters, else ValueError."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise ValueError(
            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters, got "
            f"{request_id[:40]!r} ({len(request_id)} characters)"
        )
    return request_id


def check_prompt(token_ids: Sequence[int]) -> list[int]:
    """The prompt as a list; the engine checks the vocabulary range and the context length."""
    if not token_ids:
        raise ValueError("prompt_token_ids is empty: give at least one token id")
    return list(token_ids)


@dataclass(slots=True, frozen=True)
class PromptLimits:
    """The model's limits, checked at the edge of the roles that do not hand a request
    to the engine at once (a prefill checks its destination next, a decode its
    reservation), so that a bad prompt is named before anything else."""

    vocab_size: int
    max_model_len: int

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> None:
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{field} must be in [0, {self.vocab_size}); got {bad[:5]}")

    def check_context(self, prompt_tokens: int, max_tokens: int = 1) -> None:
        """ValueError unless the prompt and ``max_tokens`` more fit the model context."""
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the model context of {self.max_model_len} tokens; shorten the "
                "prompt or lower max_tokens"
            )
