"""The planner's own cost: ``Planner.decide`` with 1,000 worker observations."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from pdserve.bench.autoscale_sim.model import CostModel, Slo, capacity_profile
from pdserve.cluster.autoscale import (
    ClusterObservation,
    LoadSample,
    Planner,
    PlannerConfig,
    PoolLimits,
    PoolObservation,
    WorkerObservation,
)
from pdserve.cluster.pool_manager import MemberState


@dataclass(frozen=True, slots=True)
class DecisionCost:
    workers: int
    repeats: int
    decide_median_ms: float
    decide_p90_ms: float
    observe_median_ms: float  # building the 1,000 WorkerObservation values


def _workers(role: str, count: int, phase: int) -> tuple[WorkerObservation, ...]:
    """Ready workers with varied loads; every 50th still starting."""
    out = []
    for i in range(count):
        starting = i % 50 == 49
        state = MemberState.STARTING if starting else MemberState.READY
        running = 0 if starting else (i * 7 + phase) % 24
        out.append(
            WorkerObservation(
                f"{role}-{i}",
                state,
                100.0 * phase,
                running,
                (i + phase) % 3,
                min(1.0, running / 28),
                (i * 13) % 500,
                (i * 5) % 40,
            )
        )
    return tuple(out)


def measure(workers: int = 1000, repeats: int = 201) -> DecisionCost:
    """Median over ``repeats`` decisions, 10 s apart, on pools of ``workers`` in all."""
    cost, slo = CostModel(), Slo()
    profile = capacity_profile(cost, 512, 256, slo)
    limits = PoolLimits(1, 4 * workers, workers // 4, workers // 8)
    planner = Planner(PlannerConfig(prefill=limits, decode=limits), profile)
    half = workers // 2
    decide, observe = [], []
    for k in range(repeats):
        t0 = time.perf_counter()
        obs = ClusterObservation(
            LoadSample(100.0 + k % 7, 512.0, 256.0),
            PoolObservation(_workers("prefill", half, k), 0.99, 0.40),
            PoolObservation(_workers("decode", workers - half, k), 0.99, 0.12),
        )
        t1 = time.perf_counter()
        planner.decide(10.0 * k, obs)
        t2 = time.perf_counter()
        observe.append(t1 - t0)
        decide.append(t2 - t1)
    decide.sort()
    return DecisionCost(
        workers,
        repeats,
        1000 * statistics.median(decide),
        1000 * decide[int(0.9 * (len(decide) - 1))],
        1000 * statistics.median(observe),
    )
