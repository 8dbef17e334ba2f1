"""Applying a step's results: advance computed tokens, append samples, stop, fork siblings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.engine.scheduler.finishing import Finisher
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.stopping import stop_status

# What a sampled chunk produced: one token, or the tokens a verify chunk accepted.
Sampled = int | tuple[int, ...]


@dataclass(slots=True, frozen=True)
class SequenceUpdate:
    """What one step did to a sequence that sampled: its new tokens and whether it ended.

    One token per step, or several after a verify chunk (the accepted candidates and the
    token sampled after them), cut at the first one that ends the sequence.
    """

    seq_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None


class StepUpdater:
    """``Scheduler.update``: the bookkeeping after the runner executed a plan."""

    __slots__ = ("_finisher", "_state")

    def __init__(self, state: SchedulerState, finisher: Finisher) -> None:
        self._state = state
        self._finisher = finisher

    def apply(self, plan: BatchPlan, sampled: Mapping[str, Sampled]) -> list[SequenceUpdate]:
        self._check_sampled(plan, sampled)
        updates: list[SequenceUpdate] = []
        for chunk in plan.chunks:
            seq = self._state.running.get(chunk.seq_id)
            if seq is None:
                continue  # aborted or finished between schedule() and update()
            if not chunk.sample:
                self._advance(seq, chunk, chunk.end_pos)
                continue
            value = sampled[chunk.seq_id]
            tokens = (value,) if isinstance(value, int) else tuple(value)
            self._check_tokens(chunk, tokens)
            kept, status = self._append(seq, tokens)
            # A verify chunk keeps the root and the accepted candidates (the K/V of the
            # last token, drawn after them, is computed next step).
            self._advance(seq, chunk, chunk.start_pos + len(kept) if chunk.tree else chunk.end_pos)
            if status is not None:
                self._finisher.finish_running(seq, status)
            updates.append(SequenceUpdate(seq.seq_id, kept, status is not None, seq.finish_reason))
        return updates

    def _check_tokens(self, chunk: ScheduledChunk, tokens: tuple[int, ...]) -> None:
        most = len(chunk.token_ids) if chunk.tree else 1
        if not 1 <= len(tokens) <= most:
            raise ValueError(
                f"{chunk.seq_id!r} sampled {len(tokens)} tokens; its chunk gives 1 to {most}"
            )

    def _check_sampled(self, plan: BatchPlan, sampled: Mapping[str, Sampled]) -> None:
        expected = {c.seq_id for c in plan.chunks if c.sample}
        missing = sorted(i for i in expected - set(sampled) if i in self._state.running)
        unexpected = sorted(set(sampled) - expected)
        if missing or unexpected:
            raise ValueError(
                "sampled tokens must cover exactly the plan's sample=True chunks: "
                f"missing {missing}, not sampling this step {unexpected}"
            )

    def _advance(self, seq: Sequence, chunk: ScheduledChunk, computed: int) -> None:
        assert seq.num_computed_tokens == chunk.start_pos, (
            f"{seq.seq_id!r} has {seq.num_computed_tokens} computed tokens but its chunk "
            f"starts at {chunk.start_pos}"
        )
        seq.num_computed_tokens = computed
        kv = self._state.kv
        if chunk.tree:
            kv.truncate(seq.seq_id, computed)  # the rejected candidates' slots go back
        if computed // kv.block_size > chunk.start_pos // kv.block_size:
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

    def _append(
        self, seq: Sequence, tokens: tuple[int, ...]
    ) -> tuple[tuple[int, ...], SequenceStatus | None]:
        """Append ``tokens`` up to the first that ends the sequence; returns them and the
        status it ends with (the caller finishes it after its K/V bookkeeping)."""
        for count, token_id in enumerate(tokens, start=1):
            seq.output_token_ids.append(token_id)
            status = stop_status(seq, self._state.max_model_len)
            if status is not None:
                return tokens[:count], status
        return tokens, None
