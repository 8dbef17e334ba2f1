"""Continuous-batching scheduler (pure; no torch). See ``scheduler.py`` for the step loop."""

from pdserve.engine.scheduler.config import SchedulerConfig
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.scheduler import Scheduler, SchedulerStats
from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.update import SequenceUpdate

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
