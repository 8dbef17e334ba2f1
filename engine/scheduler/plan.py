"""The plan of one engine step: what the scheduler decided and the model runner executes.

The runner never decides policy and the scheduler never touches tensors; this file is the
whole contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler.token_tree import TokenTree


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

    A *verify chunk* (``tree`` set) is the sequence's one pending token followed by a
    :class:`TokenTree` of speculative candidates: ``token_ids == (root, *tree.tokens)``,
    every row is sampled, and the block table also covers the tree's slots (see
    ``token_tree.py`` for positions, slots and attention).
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    tree: TokenTree | None = None

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits this chunk gets: every row of a verify chunk, else 0 or 1."""
        if self.tree is not None:
            return len(self.token_ids)
        return 1 if self.sample else 0

    @property
    def row_parents(self) -> tuple[int, ...]:
        """Verify chunk: the parent row of each row (-1 for the root); else () (causal)."""
        if self.tree is None:
            return ()
        return (-1, *(p + 1 for p in self.tree.parents))

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
