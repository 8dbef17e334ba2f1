"""Phase 1 of a step: every running sequence with one pending token decodes it, with its
speculative candidates when they fit."""

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

    A sequence's ``proposal`` (a token tree) rides along only with what is spare: budget left
    after one token for every decoding sequence, and free blocks beyond one for each
    decoding sequence still to come. Speculation never preempts; a tree that does not fit
    is cut to a preorder prefix or dropped.
    """

    __slots__ = ("_preemptor", "_state")

    def __init__(self, state: SchedulerState, preemptor: Preemptor) -> None:
        self._state = state
        self._preemptor = preemptor

    def schedule(self, step: StepBuilder) -> None:
        decoding = [s for s in self._state.running_by_arrival() if s.num_pending_tokens == 1]
        spare_tokens = step.remaining_tokens - len(decoding)
        trees = [s.proposal for s in decoding]
        for seq in decoding:
            seq.proposal = None  # taken: a proposal lives for one step
        for i, (seq, tree) in enumerate(zip(decoding, trees, strict=True)):
            if seq.seq_id not in self._state.running:
                continue  # preempted earlier in this loop to make room
            if step.remaining_tokens < 1:
                return
            if tree and spare_tokens > 0:
                tree = tree.truncated(spare_tokens)
                block_table = self._allocate_tree(seq, len(tree), len(decoding) - i - 1)
                if block_table is not None:
                    step.add_tree(seq, tree, block_table)
                    spare_tokens -= len(tree)
                    continue
            block_table = self._allocate_or_preempt(seq, step)
            if block_table is not None:
                step.add(seq, 1, block_table)

    def _allocate_tree(self, seq: Sequence, num_nodes: int, num_after: int) -> list[int] | None:
        kv = self._state.kv
        end = seq.num_tokens + num_nodes
        num_new_blocks = kv.num_blocks_for_tokens(end) - len(kv.block_table(seq.seq_id))
        if kv.num_free_blocks - num_new_blocks < num_after:
            return None  # keep a block for each later sequence's decode
        return kv.allocate(
            seq.seq_id,
            seq.token_view,
            seq.num_computed_tokens,
            num_new_tokens=1,
            num_lookahead_tokens=num_nodes,
        )

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
