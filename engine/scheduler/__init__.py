"""Continuous-batching scheduler (pure; no torch). See ``scheduler.py`` for the step loop."""

from engine.scheduler.config import SchedulerConfig
from engine.scheduler.plan import BatchPlan, ScheduledChunk
from engine.scheduler.scheduler import Scheduler, SchedulerStats
from engine.scheduler.sequence import Sequence, SequenceStatus
from engine.scheduler.update import SequenceUpdate

__all__ = [
    "BatchPlan",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "SequenceUpdate",
]
