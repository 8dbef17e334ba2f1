"""What `pdserve up` ships to each worker actor: the worker to run, and how it registers."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.cluster.cpu_affinity import CpuAffinity
from pdserve.cluster.worker_agent import AgentConfig, start_worker_agent
from pdserve.engine.kv_cache.tier_options import kv_tier_flags
from pdserve.worker.host import Register, WorkerSpec


@dataclass(slots=True, frozen=True)
class WorkerLaunch:
    """Everything needed to run one worker (picklable: Ray ships it to the actor)."""

    worker: WorkerSpec
    redis_url: str = field(repr=False)  # carries the Redis password
    agent: AgentConfig = field(default_factory=AgentConfig)
    log_level: str = "INFO"
    cpu_affinity: CpuAffinity = ()  # per pool (cluster/cpu_affinity.py); () = not pinned
    # more worker server flags for the workers of one role (speculation: not on prefill)
    role_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # the KV tier flags' CacheConfig fields, for every role (each keeps a prefix cache)
    kv_tiers: Mapping[str, Any] = field(default_factory=dict)

    def for_worker(self, role: str, worker_id: str) -> WorkerLaunch:
        """This launch as one worker's: its role and id, its role's own flags, and its own
        disk tier directory (a subdirectory named by its id)."""
        tiers = kv_tier_flags(self.kv_tiers, worker_id)
        extra_args = (*self.worker.extra_args, *self.role_args.get(role, ()), *tiers)
        worker = replace(self.worker, role=role, worker_id=worker_id, extra_args=extra_args)
        return replace(self, worker=worker)

    def register(self) -> Register:
        """The worker's registration: its agent in this launch's Redis."""
        return functools.partial(start_worker_agent, self.redis_url, config=self.agent)
