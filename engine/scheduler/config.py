"""Scheduler settings (one frozen dataclass; built by the caller, validated here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching.

    ``max_num_batched_tokens``: token budget of one step (decode tokens + prefill chunks).
    ``max_num_seqs``: sequences running at once (each decode takes 1 token of the budget, so
    the budget must be at least this). ``long_prefill_token_threshold``: the largest prefill
    chunk one sequence gets per step when chunking (None = the whole budget).
    ``max_model_len``: longest sequence (prompt + output) in tokens; None = what the KV
    pool holds. A sequence reaching it finishes with reason ``"length"``.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode "
                "each step; raise the budget or lower max_num_seqs"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and not 1 <= threshold <= self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_token_threshold must be in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {threshold}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def max_chunk_tokens(self) -> int:
        """Largest prefill chunk per sequence per step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens
