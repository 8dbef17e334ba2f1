"""Applying a step's results: advance computed tokens, append samples, stop, fork siblings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.engine.scheduler.finishing import Finisher
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.stopping import stop_status


@dataclass(slots=True, frozen=True)
class SequenceUpdate:
    """What one step did to a sequence that sampled: its new token and whether it ended."""

    seq_id: str
    new_token_id: int | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None


class StepUpdater:
    """``Scheduler.update``: the bookkeeping after the runner executed a plan."""

    __slots__ = ("_finisher", "_state")

    def __init__(self, state: SchedulerState, finisher: Finisher) -> None:
        self._state = state
        self._finisher = finisher

    def apply(self, plan: BatchPlan, sampled: Mapping[str, int]) -> list[SequenceUpdate]:
        self._check_sampled(plan, sampled)
        updates: list[SequenceUpdate] = []
        for chunk in plan.chunks:
            seq = self._state.running.get(chunk.seq_id)
            if seq is None:
                continue  # aborted or finished between schedule() and update()
            self._advance(seq, chunk)
            if chunk.sample:
                updates.append(self._append(seq, sampled[chunk.seq_id]))
        return updates

    def _check_sampled(self, plan: BatchPlan, sampled: Mapping[str, int]) -> None:
        expected = {c.seq_id for c in plan.chunks if c.sample}
        missing = sorted(i for i in expected - set(sampled) if i in self._state.running)
        unexpected = sorted(set(sampled) - expected)
        if missing or unexpected:
            raise ValueError(
                "sampled tokens must cover exactly the plan's sample=True chunks: "
                f"missing {missing}, not sampling this step {unexpected}"
            )

    def _advance(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        assert seq.num_computed_tokens == chunk.start_pos, (
            f"{seq.seq_id!r} has {seq.num_computed_tokens} computed tokens but its chunk "
            f"starts at {chunk.start_pos}"
        )
        seq.num_computed_tokens = chunk.end_pos
        kv = self._state.kv
        if chunk.end_pos // kv.block_size > chunk.start_pos // kv.block_size:
            # A block just filled: offer it to the prefix cache.
            kv.commit_computed(seq.seq_id, seq.token_view, seq.num_computed_tokens)
        for sibling in self._state.groups.pop_ready(seq):
            self._fork(seq, sibling)

    def _fork(self, leader: Sequence, sibling: Sequence) -> None:
        """Share the leader's prompt blocks; the sibling recomputes the last prompt token
        (into its own copy-on-write block) to sample its own first token."""
        self._state.kv.fork(leader.seq_id, sibling.seq_id)
        sibling.num_computed_tokens = leader.prompt_len - 1
        sibling.status = SequenceStatus.RUNNING
        self._state.running[sibling.seq_id] = sibling

    def _append(self, seq: Sequence, token_id: int) -> SequenceUpdate:
        seq.output_token_ids.append(token_id)
        status = stop_status(seq, self._state.max_model_len)
        if status is not None:
            self._finisher.finish_running(seq, status)
        return SequenceUpdate(seq.seq_id, token_id, status is not None, seq.finish_reason)
