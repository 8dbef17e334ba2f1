"""Phase 1 of a step: every running sequence with one pending token decodes it."""

from __future__ import annotations

from pdserve.engine.scheduler.preemption import Preemptor
from pdserve.engine.scheduler.sequence import Sequence
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.step import StepBuilder


class DecodeScheduler:
    """Gives each decoding sequence its 1 token, oldest first, preempting to find blocks.

    When a sequence cannot get a block, the newest running sequence not yet scheduled this
    step is preempted and the allocation retried; if that newest one is the sequence itself,
    it is preempted and skipped. Older sequences therefore never lose their KV to newer ones.
    """

    __slots__ = ("_preemptor", "_state")

    def __init__(self, state: SchedulerState, preemptor: Preemptor) -> None:
        self._state = state
        self._preemptor = preemptor

    def schedule(self, step: StepBuilder) -> None:
        decoding = [s for s in self._state.running_by_arrival() if s.num_pending_tokens == 1]
        for seq in decoding:
            if seq.seq_id not in self._state.running:
                continue  # preempted earlier in this loop to make room
            if step.remaining_tokens < 1:
                return
            block_table = self._allocate_or_preempt(seq, step)
            if block_table is not None:
                step.add(seq, 1, block_table)

    def _allocate_or_preempt(self, seq: Sequence, step: StepBuilder) -> list[int] | None:
        kv = self._state.kv
        while True:
            block_table = kv.allocate(
                seq.seq_id, seq.token_view, seq.num_computed_tokens, num_new_tokens=1
            )
            if block_table is not None:
                return block_table
            victim = self._preemptor.pick_victim(step.scheduled_ids)
            self._preemptor.preempt(victim, step)
            if victim is seq:
                return None
