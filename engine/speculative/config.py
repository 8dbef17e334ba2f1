"""Speculative decoding settings (one frozen dataclass; validated here)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "ngram", "draft")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """How candidates are proposed and how many a step verifies.

    ``method``: ``ngram`` (prompt lookup: continuations of earlier occurrences of the last
    few tokens), ``draft`` (a smaller model with the same tokenizer, ``draft_model``) or
    ``off``. ``num_speculative_tokens``: deepest candidate (tokens past the pending one).
    ``max_tree_nodes``: candidates per sequence per step (a tree: several branches).
    ``max_verify_tokens``: a step speculates only while every decoding sequence's one
    token plus all candidates fit this many tokens: past it decode stops being bound by
    reading the weights and verifying costs more than it saves (see docs/speculative.md).
    ``min_acceptance``: a sequence whose candidates are accepted less than this on average
    (candidates per verify step) pauses speculating, trying again now and then.
    """

    method: str = "off"
    num_speculative_tokens: int = 8
    max_tree_nodes: int = 16
    max_verify_tokens: int = 16
    min_acceptance: float = 0.5
    ngram_min: int = 2
    ngram_max: int = 5
    ngram_branches: int = 4
    draft_model: str | None = None
    draft_num_blocks: int = 512

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (--draft-model)")
        for name in ("num_speculative_tokens", "max_tree_nodes", "ngram_min", "ngram_branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ngram_max < self.ngram_min:
            raise ValueError(
                f"ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})"
            )
        if self.max_verify_tokens < 2:
            raise ValueError(f"max_verify_tokens must be >= 2, got {self.max_verify_tokens}")
        if self.min_acceptance < 0:
            raise ValueError(f"min_acceptance must be >= 0, got {self.min_acceptance}")
        if self.draft_num_blocks < 2:
            raise ValueError(f"draft_num_blocks must be >= 2, got {self.draft_num_blocks}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"
