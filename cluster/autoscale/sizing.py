"""Sizing arithmetic: load and profile -> tokens/s to absorb and replicas needed.

prefill: prompt tokens/s ÷ (prefill tokens/s per worker ÷ correction)
decode:  output tokens/s ÷ (decode tokens/s per worker at the SLO batch ÷ correction)

The correction is observed ÷ expected latency (as Dynamo's planner does): a pool slower
than its profile says (contention, longer contexts, queueing) gets proportionally more
replicas. Expected latency comes from the profile: the prefill time of a mean prompt, or
the ITL at the current batch per decode worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.cluster.autoscale.config import PlannerConfig
from pdserve.cluster.autoscale.observations import LoadSample, PoolObservation, PoolSummary
from pdserve.cluster.autoscale.profile import CapacityProfile

# Float slack for ceil: 4000 / 800 must be 5 replicas, not 6.
_CEIL_SLACK = 1e-9


@dataclass(slots=True, frozen=True)
class PoolDemand:
    """What a pool must absorb and what one replica absorbs, in tokens/s.

    ``up_tokens_per_s``: forecast for when a replica ordered now would serve (now + start-up
    time). ``down_tokens_per_s``: the larger of the smoothed load now and that forecast, so a
    replica is only removed when both fit. ``unit``: "input" or "output" (for reasons).
    """

    up_tokens_per_s: float
    down_tokens_per_s: float
    replica_tokens_per_s: float
    correction: float
    unit: str


def replicas_for(tokens_per_s: float, replica_tokens_per_s: float, utilization: float) -> int:
    """Replicas needed to run ``tokens_per_s`` with each at most ``utilization`` busy."""
    if replica_tokens_per_s <= 0 or utilization <= 0:
        raise ValueError(
            f"capacity and utilization must be > 0, got {replica_tokens_per_s}, {utilization}"
        )
    return max(0, math.ceil(tokens_per_s / (replica_tokens_per_s * utilization) - _CEIL_SLACK))


def latency_correction(
    observed_s: float | None,
    expected_s: float,
    slo_attainment: float | None,
    config: PlannerConfig,
) -> float:
    """observed ÷ expected latency, clamped; 1 when nothing was observed.

    While SLO attainment is under target the factor is at least 1: a pool missing its SLO
    is never judged faster than its profile.
    """
    factor = 1.0
    if observed_s is not None and expected_s > 0:
        factor = min(config.correction_max, max(config.correction_min, observed_s / expected_s))
    if slo_attainment is not None and slo_attainment < config.slo_attainment_min:
        factor = max(factor, 1.0)
    return factor


def prefill_demand(
    up: LoadSample,
    now: LoadSample,
    pool: PoolObservation,
    profile: CapacityProfile,
    config: PlannerConfig,
) -> PoolDemand:
    """``up``: the load forecast at now + start-up time; ``now``: the smoothed load now."""
    expected_s = profile.prefill_s(now.mean_input_tokens)
    correction = latency_correction(
        pool.observed_latency_s, expected_s, pool.slo_attainment, config
    )
    return PoolDemand(
        up_tokens_per_s=up.input_tokens_per_s,
        down_tokens_per_s=max(up.input_tokens_per_s, now.input_tokens_per_s),
        replica_tokens_per_s=profile.prefill_tokens_per_s / correction,
        correction=correction,
        unit="input",
    )


def decode_demand(
    up: LoadSample,
    now: LoadSample,
    pool: PoolObservation,
    summary: PoolSummary,
    profile: CapacityProfile,
    config: PlannerConfig,
) -> PoolDemand:
    """As :func:`prefill_demand`; the expected ITL is the profile's at the pool's current
    batch per ready worker."""
    batch = summary.running_requests / summary.ready if summary.ready else 1.0
    expected_s = profile.itl_s_at(max(1.0, batch))
    correction = latency_correction(
        pool.observed_latency_s, expected_s, pool.slo_attainment, config
    )
    return PoolDemand(
        up_tokens_per_s=up.output_tokens_per_s,
        down_tokens_per_s=max(up.output_tokens_per_s, now.output_tokens_per_s),
        replica_tokens_per_s=profile.decode_tokens_per_s / correction,
        correction=correction,
        unit="output",
    )
