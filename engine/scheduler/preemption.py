"""Preemption by recompute: free a running sequence's KV and queue it to be recomputed."""

from __future__ import annotations

from collections.abc import Set

from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.step import StepBuilder


class Preemptor:
    """Chooses victims (newest arrival first) and preempts them."""

    __slots__ = ("_state",)

    def __init__(self, state: SchedulerState) -> None:
        self._state = state

    def pick_victim(self, protected_ids: Set[str]) -> Sequence:
        """The most recently arrived running sequence not already scheduled this step."""
        candidates = [s for s in self._state.running.values() if s.seq_id not in protected_ids]
        assert candidates, "no running sequence left to preempt"
        return max(candidates, key=lambda s: s.arrival)

    def preempt(self, seq: Sequence, step: StepBuilder) -> None:
        """Free ``seq``'s blocks; it goes to the front of the waiting queue and will recompute
        prompt + outputs (possibly hitting the prefix cache)."""
        state = self._state
        state.kv.free(seq.seq_id)
        del state.running[seq.seq_id]
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        state.waiting.push_front(seq)
        state.num_preemptions += 1
        step.preempted_ids.append(seq.seq_id)
