"""Continuous batching: the step policy in front of a paged KV cache. Pure Python.

The engine loop around it::

    scheduler = Scheduler(SchedulerConfig(), kv)        # kv: KVCacheManager
    scheduler.add(seq)                                  # or add_group(seqs) for n > 1
    while scheduler.has_unfinished():
        plan = scheduler.schedule()                     # BatchPlan: chunks, COW copies
        sampled = runner.execute(plan)                  # {seq_id: token} for sample=True
        for u in scheduler.update(plan, sampled):       # SequenceUpdate per sampled seq
            ...stream u.new_token_ids; call scheduler.finish(u.seq_id, "stop") on stop strings

A step is decode-first and stall-free: every running sequence with one pending token gets
it (preempting the newest sequences by recompute if blocks run out), then prefill chunks
fill the remaining token budget FCFS (:mod:`pdserve.engine.scheduler.prefill`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.scheduler.config import SchedulerConfig
from pdserve.engine.scheduler.decode import DecodeScheduler
from pdserve.engine.scheduler.finishing import Finisher
from pdserve.engine.scheduler.plan import BatchPlan
from pdserve.engine.scheduler.preemption import Preemptor
from pdserve.engine.scheduler.prefill import PrefillScheduler
from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState
from pdserve.engine.scheduler.step import StepBuilder
from pdserve.engine.scheduler.update import Sampled, SequenceUpdate, StepUpdater

_FINISH_BY_REASON = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
}


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int  # includes n > 1 siblings not forked yet
    num_held: int
    num_preemptions: int
    num_free_blocks: int
    kv_usage: float
    prefix_hit_tokens: int
    prefix_queried_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(1, self.prefix_queried_tokens)


class Scheduler:
    """Decides each step's batch; owns sequence state; never touches tensors.

    ``max_model_len`` is the config's, capped at what the KV pool holds.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        capacity_tokens = kv.num_blocks * kv.block_size
        max_len = min(config.max_model_len or capacity_tokens, capacity_tokens)
        self._state = SchedulerState(config, kv, max_len)
        preemptor = Preemptor(self._state)
        self._finisher = Finisher(self._state)
        self._decode = DecodeScheduler(self._state, preemptor)
        self._prefill = PrefillScheduler(self._state)
        self._updater = StepUpdater(self._state, self._finisher)

    @property
    def config(self) -> SchedulerConfig:
        return self._state.config

    @property
    def kv(self) -> KVCacheManager:
        return self._state.kv

    @property
    def max_model_len(self) -> int:
        return self._state.max_model_len

    # -- intake ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS). Raises ValueError on a bad or duplicate sequence."""
        self._check_new(seq)
        self._state.stamp_arrival(seq)
        self._state.seqs[seq.seq_id] = seq
        self._state.waiting.push_back(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """Queue ``n`` samples of one prompt: ``seqs[0]`` prefills; the others fork from it
        once its prompt KV is computed."""
        if not seqs:
            raise ValueError("add_group needs at least one sequence")
        if len(seqs) > self.config.max_num_seqs:
            raise ValueError(
                f"a group of {len(seqs)} sequences can never run with max_num_seqs="
                f"{self.config.max_num_seqs}; lower n or raise max_num_seqs"
            )
        leader, siblings = seqs[0], seqs[1:]
        if any(
            s.prompt_token_ids != leader.prompt_token_ids or s.output_token_ids for s in siblings
        ):
            raise ValueError("a group's sequences must share one prompt and have no output yet")
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise ValueError(f"duplicate seq_id in group {[s.seq_id for s in seqs]}")
        for seq in seqs:
            self._check_new(seq)
        self.add(leader)
        for sibling in siblings:
            self._state.stamp_arrival(sibling)
            self._state.seqs[sibling.seq_id] = sibling
        self._state.groups.add(leader, siblings)

    def admit_imported(self, seq: Sequence) -> bool:
        """Decode role: run ``seq`` whose prompt KV was imported into its reserved blocks
        (``kv.reserve_for_import``) and whose first token is in ``output_token_ids``.

        Commits the import and puts ``seq`` straight into the running set with its prompt
        computed. Returns False (nothing changed) when ``max_num_seqs`` are running.
        """
        self._check_new(seq, imported=True)
        expected_blocks = self.kv.num_blocks_for_tokens(seq.prompt_len)
        if seq.seq_id not in self.kv or len(self.kv.block_table(seq.seq_id)) != expected_blocks:
            raise ValueError(
                f"admit_imported({seq.seq_id!r}) needs a reservation of {expected_blocks} "
                "blocks for its prompt; call kv.reserve_for_import first"
            )
        if not self._state.has_seq_slots(1):
            return False
        self.kv.commit_import(seq.seq_id)
        self._state.stamp_arrival(seq)
        seq.num_computed_tokens = seq.prompt_len
        seq.status = SequenceStatus.RUNNING
        self._state.seqs[seq.seq_id] = seq
        self._state.running[seq.seq_id] = seq
        return True

    # -- the step --------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Decide this step's batch. An empty plan means nothing can run now."""
        step = StepBuilder(self.config.max_num_batched_tokens)
        if self._prefill.needs_solo_step():
            self._prefill.schedule(step, admit_waiting=True)
            if not step.is_empty:
                return step.build(self.kv.take_block_copies())
        self._decode.schedule(step)
        # After a preemption, admitting new work would only thrash the pool.
        self._prefill.schedule(step, admit_waiting=not step.preempted_ids)
        return step.build(self.kv.take_block_copies())

    def update(self, plan: BatchPlan, sampled: Mapping[str, Sampled]) -> list[SequenceUpdate]:
        """Apply the results of ``plan``: ``sampled`` maps each ``sample=True`` chunk's
        seq_id to its new token. Returns one update per sampled sequence, in plan order."""
        return self._updater.apply(plan, sampled)

    # -- endings ---------------------------------------------------------------------
    def finish(self, seq_id: str, reason: str | SequenceStatus = "stop") -> bool:
        """End a sequence for a reason decided outside (stop strings): ``"stop"``,
        ``"length"`` or ``"abort"``. False if it is unknown or already finished."""
        status = _FINISH_BY_REASON.get(reason) if isinstance(reason, str) else reason
        if status is None or not status.is_finished:
            raise ValueError(
                f"finish reason must be one of {list(_FINISH_BY_REASON)}, got {reason!r}"
            )
        return self._finisher.finish(seq_id, status)

    def abort(self, seq_id: str) -> bool:
        """Cancel a sequence and free its KV (also KV held after finishing)."""
        return self._finisher.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def release(self, seq_id: str) -> bool:
        """Prefill role: free the blocks a finished ``hold_kv`` sequence kept for sending."""
        return self._finisher.release(seq_id)

    # -- inspection ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        state = self._state
        return bool(state.running or state.waiting or state.groups.num_pending())

    @property
    def num_waiting(self) -> int:
        return len(self._state.waiting) + self._state.groups.num_pending()

    @property
    def num_running(self) -> int:
        return len(self._state.running)

    @property
    def num_held(self) -> int:
        return len(self._state.held)

    def decoding(self) -> list[Sequence]:
        """Running sequences with one token to compute (they may speculate), oldest first."""
        return [s for s in self._state.running_by_arrival() if s.num_pending_tokens == 1]

    def get(self, seq_id: str) -> Sequence | None:
        """A live (unfinished, or finished and holding KV) sequence by id."""
        return self._state.seqs.get(seq_id)

    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_held=self.num_held,
            num_preemptions=self._state.num_preemptions,
            num_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_queried_tokens=kv.prefix_queried_tokens,
        )

    def _check_new(self, seq: Sequence, imported: bool = False) -> None:
        if seq.seq_id in self._state.seqs:
            raise ValueError(f"seq_id {seq.seq_id!r} is already scheduled; use a new id")
        if seq.status is not SequenceStatus.WAITING or (seq.num_computed_tokens and not imported):
            raise ValueError(
                f"sequence {seq.seq_id!r} must be new (WAITING, 0 computed tokens), got "
                f"{seq.status.name} with {seq.num_computed_tokens} computed"
            )
        if imported and not seq.output_token_ids:
            raise ValueError(f"imported sequence {seq.seq_id!r} needs its first sampled token")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len} to generate anything"
            )
