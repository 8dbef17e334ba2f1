"""The scheduler's shared state, read and changed by its small managers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.scheduler.config import SchedulerConfig
from pdserve.engine.scheduler.groups import SiblingGroups
from pdserve.engine.scheduler.sequence import Sequence
from pdserve.engine.scheduler.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerState:
    """Where every live sequence is.

    ``seqs``: every sequence not yet forgotten (unfinished, or finished but holding KV).
    ``waiting``: holds no blocks (new or preempted). ``running``: holds blocks and is
    scheduled each step. ``held``: finished with ``hold_kv``; blocks kept until released.
    ``groups``: ``n > 1`` siblings waiting for their leader's prompt.
    """

    config: SchedulerConfig
    kv: KVCacheManager
    max_model_len: int
    seqs: dict[str, Sequence] = field(default_factory=dict)
    waiting: WaitingQueue = field(default_factory=WaitingQueue)
    running: dict[str, Sequence] = field(default_factory=dict)
    held: dict[str, Sequence] = field(default_factory=dict)
    groups: SiblingGroups = field(default_factory=SiblingGroups)
    num_preemptions: int = 0
    next_arrival: int = 0

    def running_by_arrival(self) -> list[Sequence]:
        return sorted(self.running.values(), key=lambda s: s.arrival)

    def num_seq_slots_used(self) -> int:
        """Running sequences plus the siblings their leaders will fork."""
        return len(self.running) + self.groups.reserved_slots(self.running)

    def has_seq_slots(self, num_seqs: int) -> bool:
        return self.num_seq_slots_used() + num_seqs <= self.config.max_num_seqs

    def stamp_arrival(self, seq: Sequence) -> None:
        seq.arrival = self.next_arrival
        self.next_arrival += 1
