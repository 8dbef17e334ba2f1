"""Building one step's :class:`BatchPlan` within the token budget."""

from __future__ import annotations

from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.sequence import Sequence
from pdserve.engine.scheduler.token_tree import TokenTree


class StepBuilder:
    """Collects chunks in order and tracks the remaining token budget of the step."""

    __slots__ = ("_budget_tokens", "_chunks", "num_tokens", "preempted_ids", "scheduled_ids")

    def __init__(self, budget_tokens: int) -> None:
        self._budget_tokens = budget_tokens
        self._chunks: list[ScheduledChunk] = []
        self.num_tokens = 0
        self.scheduled_ids: set[str] = set()
        self.preempted_ids: list[str] = []

    @property
    def remaining_tokens(self) -> int:
        return max(0, self._budget_tokens - self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self._chunks

    def add(self, seq: Sequence, num_tokens: int, block_table: list[int]) -> None:
        """Schedule ``num_tokens`` of ``seq`` from its first uncomputed position."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        assert num_tokens > 0 and end <= seq.num_tokens, (
            f"chunk {start}..{end} of {seq.seq_id!r} exceeds its {seq.num_tokens} tokens"
        )
        chunk = ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_slice(start, end)),
            start_pos=start,
            block_table=tuple(block_table),
            sample=end == seq.num_tokens,
        )
        self._chunks.append(chunk)
        self.num_tokens += num_tokens
        self.scheduled_ids.add(seq.seq_id)

    def add_tree(self, seq: Sequence, tree: TokenTree, block_table: list[int]) -> None:
        """Schedule ``seq``'s one pending token with a tree of candidates to verify."""
        assert seq.num_pending_tokens == 1 and tree, f"{seq.seq_id!r} cannot verify a tree"
        chunk = ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=(seq.token_view[-1], *tree.tokens),
            start_pos=seq.num_computed_tokens,
            block_table=tuple(block_table),
            sample=True,
            tree=tree,
        )
        self._chunks.append(chunk)
        self.num_tokens += chunk.num_tokens
        self.scheduled_ids.add(seq.seq_id)

    def build(self, block_copies: list[tuple[int, int]]) -> BatchPlan:
        return BatchPlan(tuple(self._chunks), tuple(block_copies), tuple(self.preempted_ids))
