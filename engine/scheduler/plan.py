"""The plan of one engine step: what the scheduler decided and the model runner executes.

The runner never decides policy and the scheduler never touches tensors; this file is the
whole contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: a decode token or a chunk of prefill tokens.

    ``token_ids`` are the tokens whose KV is computed this step, at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; positions before ``start_pos`` are
    already in the cache. ``block_table`` lists the physical blocks that hold positions
    ``0 .. start_pos + len(token_ids) - 1`` (position p lives in block
    ``block_table[p // block_size]`` at offset ``p % block_size``).
    ``sample`` is true when the chunk ends at the sequence's last known token, so the
    runner must return logits for its last position.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """Context length after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True, frozen=True)
class BatchPlan:
    """A step: decode chunks first, then prefill chunks, within the token budget."""

    chunks: tuple[ScheduledChunk, ...] = ()
    # Copy-on-write: (src_block, dst_block) pairs the runner copies before the forward.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Sequences preempted (their KV freed, to be recomputed) while building this plan.
    preempted_seq_ids: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.block_copies
