"""A sequence: one generation stream (a request with ``n > 1`` has one per sample)."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import overload

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler.token_tree import TokenTree


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV freed; waits to be recomputed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: ``"stop"``, ``"length"``, ``"abort"``; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutable scheduling state of one sequence; the scheduler owns the counters.

    Positions ``0 .. num_computed_tokens - 1`` have their KV in the cache. The tokens still to
    compute are ``all_token_ids[num_computed_tokens:]`` (at least the last sampled one while
    running). ``arrival`` is set by the scheduler on ``add`` and orders FCFS and preemption.
    ``hold_kv`` (prefill role): on finishing, keep the blocks until ``Scheduler.release``.
    ``proposal``: speculative candidates for the next step, set by the engine before
    ``schedule`` and taken by it (verified in the step, or dropped when they do not fit).
    """

    seq_id: str
    prompt_token_ids: SequenceABC[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    hold_kv: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission (stats)
    finish_reason: str | None = None
    arrival: int = -1
    proposal: TokenTree | None = None

    def __post_init__(self) -> None:
        if not self.seq_id:
            raise ValueError("seq_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {self.seq_id!r} has an empty prompt; give >= 1 token")
        self.prompt_token_ids = tuple(self.prompt_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def token_view(self) -> TokenView:
        """Prompt + outputs as a read-only sequence, without copying (for per-step calls)."""
        return TokenView(self)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        head = list(self.prompt_token_ids[start:end])
        if end > prompt_len:
            head += self.output_token_ids[: end - prompt_len]
        return head


class TokenView(SequenceABC[int]):
    """``prompt_token_ids + output_token_ids`` of a live sequence, read lazily."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        seq = self._seq
        if isinstance(index, slice):
            start, stop, stride = index.indices(seq.num_tokens)
            if stride != 1:
                return seq.all_token_ids[index]
            return seq.token_slice(start, max(start, stop))
        position = index + seq.num_tokens if index < 0 else index
        if not 0 <= position < seq.num_tokens:
            raise IndexError(f"token index {index} out of range for {seq.num_tokens} tokens")
        if position < seq.prompt_len:
            return seq.prompt_token_ids[position]
        return seq.output_token_ids[position - seq.prompt_len]
