"""What `pdserve up` ships to each worker actor: the worker to run, and how it registers."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from pdserve.cluster.cpu_affinity import CpuAffinity
from pdserve.cluster.worker_agent import AgentConfig, start_worker_agent
from pdserve.worker.host import Register, WorkerSpec


@dataclass(slots=True, frozen=True)
class WorkerLaunch:
    """Everything needed to run one worker (picklable: Ray ships it to the actor)."""

    worker: WorkerSpec
    redis_url: str
    agent: AgentConfig = field(default_factory=AgentConfig)
    log_level: str = "INFO"
    cpu_affinity: CpuAffinity = ()  # per pool (cluster/cpu_affinity.py); () = not pinned

    def register(self) -> Register:
        """The worker's registration: its agent in this launch's Redis."""
        return functools.partial(start_worker_agent, self.redis_url, config=self.agent)
