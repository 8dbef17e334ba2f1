"""The policy packages run with torch, numpy, grpc, ray and redis unavailable (they must stay
CPU-testable and pure; import-linter checks their imports, this checks what really loads)."""

from __future__ import annotations

from tests.import_probe import run_probe

HEAVY = ("torch", "numpy", "grpc", "ray", "redis")


def test_kv_cache_and_scheduler_run_without_heavy_packages() -> None:
    run_probe(
        """
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, Sequence

kv = KVCacheManager(4, 2)
sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2), kv)
sched.add(Sequence("a", [1, 2, 3]))
assert sched.schedule().num_batched_tokens == 3
""",
        HEAVY,
    )


def test_autoscale_planner_runs_without_heavy_packages() -> None:
    run_probe(
        """
from pdserve.cluster.autoscale import (
    CapacityProfile, ClusterObservation, DecodePoint, LoadSample, Planner, PlannerConfig,
)
profile = CapacityProfile(1000.0, (DecodePoint(1, 50.0, 0.02),), 1, 10.0)
decision = Planner(PlannerConfig(), profile).decide(0.0, ClusterObservation(LoadSample(1, 1, 1)))
assert decision.prefill.replicas == 1, decision
""",
        (*HEAVY, "kubernetes"),
    )


def test_prompt_lookup_and_the_speculation_policy_run_without_heavy_packages() -> None:
    run_probe(
        """
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.policy import ProposalRequest, SpeculationPolicy

config = SpeculativeConfig(method="ngram")
limits = SpeculationPolicy(config).limits("s", 1)
trees = NgramProposer(config).propose([ProposalRequest("s", [1, 2, 3, 1, 2], limits)])
assert trees["s"].tokens[0] == 3, trees
""",
        HEAVY,
    )
