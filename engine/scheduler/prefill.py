"""Phase 2 of a step: prefill chunks, first for partly prefilled sequences, then new ones."""

from __future__ import annotations

from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.step import StepBuilder


class PrefillScheduler:
    """FCFS prefill within the budget left after decodes.

    Chunk size: with chunked prefill, ``min(pending, budget left, max_chunk_tokens)``; without
    it, the whole pending run if it fits the budget left, else the sequence waits. A run longer
    than the whole budget (chunking off) gets a step of its own (see :meth:`needs_solo_step`).
    The first sequence that cannot be scheduled (no budget, no blocks, no slot) stops the
    phase, so a large old request is not overtaken by small new ones. Prefill never preempts.
    """

    __slots__ = ("_state",)

    def __init__(self, state: SchedulerState) -> None:
        self._state = state

    def schedule(self, step: StepBuilder, admit_waiting: bool) -> None:
        partly_prefilled = [
            s
            for s in self._state.running_by_arrival()
            if s.num_pending_tokens > 1 and s.seq_id not in step.scheduled_ids
        ]
        for seq in partly_prefilled:
            if not self._continue_prefill(seq, step):
                return
        if admit_waiting:
            self._admit_waiting(step)

    def needs_solo_step(self) -> bool:
        """Chunking off and the next waiting sequence's uncached tokens exceed the budget."""
        config = self._state.config
        seq = self._state.waiting.peek()
        if config.enable_chunked_prefill or seq is None or not self._has_slot(seq):
            return False
        match = self._state.kv.lookup_prefix(seq.all_token_ids)
        return seq.num_tokens - match.num_tokens > config.max_num_batched_tokens

    def _chunk_tokens(self, num_pending: int, step: StepBuilder) -> int:
        config = self._state.config
        if config.enable_chunked_prefill:
            return min(num_pending, step.remaining_tokens, config.max_chunk_tokens)
        if num_pending <= step.remaining_tokens:
            return num_pending
        if num_pending > config.max_num_batched_tokens and step.is_empty:
            return num_pending  # would never fit: run it alone, over budget
        return 0

    def _continue_prefill(self, seq: Sequence, step: StepBuilder) -> bool:
        num_new = self._chunk_tokens(seq.num_pending_tokens, step)
        if num_new == 0:
            return False
        block_table = self._state.kv.allocate(
            seq.seq_id, seq.token_view, seq.num_computed_tokens, num_new
        )
        if block_table is None:
            return False
        step.add(seq, num_new, block_table)
        return True

    def _admit_waiting(self, step: StepBuilder) -> None:
        waiting = self._state.waiting
        while step.remaining_tokens > 0:
            seq = waiting.peek()
            if seq is None or not self._has_slot(seq) or not self._admit(seq, step):
                return
            waiting.pop()

    def _has_slot(self, seq: Sequence) -> bool:
        return self._state.has_seq_slots(1 + self._state.groups.num_siblings(seq.seq_id))

    def _admit(self, seq: Sequence, step: StepBuilder) -> bool:
        """Start (or resume) ``seq`` from the prefix cache hit; False if it must wait."""
        kv = self._state.kv
        token_ids = seq.all_token_ids
        match = kv.lookup_prefix(token_ids)
        num_new = self._chunk_tokens(len(token_ids) - match.num_tokens, step)
        if num_new == 0:
            return False
        block_table = kv.allocate(seq.seq_id, token_ids, match.num_tokens, num_new, match)
        if block_table is None:
            return False
        seq.num_computed_tokens = seq.num_cached_tokens = match.num_tokens
        seq.status = SequenceStatus.RUNNING
        self._state.running[seq.seq_id] = seq
        step.add(seq, num_new, block_table)
        return True
