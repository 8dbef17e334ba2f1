"""Autoscaling planner: exact decisions for given load, profile and pool states."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.cluster.autoscale import (
    CapacityProfile,
    ClusterObservation,
    DecodePoint,
    LoadSample,
    Planner,
    PlannerConfig,
    PoolLimits,
    PoolObservation,
    WorkerObservation,
)
from pdserve.cluster.pool_manager import MemberState, PoolTargets

READY, STARTING = MemberState.READY, MemberState.STARTING

# prefill 10,000 tokens/s per worker; decode 1,000 tokens/s at the SLO batch (16)
PROFILE = CapacityProfile(
    prefill_tokens_per_s=10_000.0,
    decode_points=(
        DecodePoint(1, 100.0, 0.010),
        DecodePoint(8, 640.0, 0.0125),
        DecodePoint(16, 1000.0, 0.016),
        DecodePoint(32, 1280.0, 0.025),
    ),
    decode_max_batch_at_slo=16,
    startup_s=20.0,
)
# 20 req/s × 1,000 prompt tokens = 20,000 tokens/s -> 20,000 / (10,000 × 0.8) = 2.5 -> 3
# 20 req/s × 200 output tokens = 4,000 tokens/s -> 4,000 / (1,000 × 0.8) = 5
LOAD = LoadSample(20.0, 1000.0, 200.0)


def config(step_up: int = 10, **overrides: Any) -> PlannerConfig:
    """Both pools 1..10 replicas, up by ``step_up``, down by 1; defaults otherwise."""
    limits = PoolLimits(min_replicas=1, max_replicas=10, max_step_up=step_up, max_step_down=1)
    return PlannerConfig(prefill=limits, decode=limits, **overrides)


def workers(role: str, n: int, state: MemberState = READY, since_s: float = -100.0,
            first: int = 0, **fields: Any) -> tuple[WorkerObservation, ...]:  # fmt: skip
    return tuple(
        WorkerObservation(f"{role}-{i}", state, since_s, **fields) for i in range(first, first + n)
    )


def cluster(prefill: int, decode: int, load: LoadSample = LOAD) -> ClusterObservation:
    """Both pools with ready, idle workers."""
    return ClusterObservation(
        load,
        PoolObservation(workers("prefill", prefill)),
        PoolObservation(workers("decode", decode)),
    )


def test_sizes_prefill_by_input_tokens_and_decode_at_the_slo_batch() -> None:
    decision = Planner(config(), PROFILE).decide(0.0, cluster(1, 1))
    assert (decision.prefill.replicas, decision.decode.replicas) == (3, 5)
    assert decision.prefill.reason.startswith("1 -> 3: 20,000 input tokens/s at 10,000")
    assert decision.decode.reason.startswith("1 -> 5: 4,000 output tokens/s at 1,000")
    assert decision.changed and decision.forecast == LOAD  # one sample: the last value
    assert decision.apply_to(PoolTargets(1, 1)) == PoolTargets(prefill=3, decode=5)


def test_latency_correction_scales_capacity_and_is_clamped() -> None:
    # prefill expects 1,000 / 10,000 = 0.1 s: observed 0.2 s -> correction 2 -> 5 replicas
    obs = ClusterObservation(LOAD, PoolObservation(workers("prefill", 1), observed_latency_s=0.2))
    assert Planner(config(), PROFILE).decide(0.0, obs).prefill.replicas == 5
    # 10× slower is clamped to correction_max = 2: still 5
    obs = ClusterObservation(LOAD, PoolObservation(workers("prefill", 1), observed_latency_s=1.0))
    assert Planner(config(), PROFILE).decide(0.0, obs).prefill.replicas == 5
    # faster than the profile: clamped to 0.8 -> 20,000 / (12,500 × 0.8) = 2
    fast = PoolObservation(workers("prefill", 1), observed_latency_s=0.01)
    assert (
        Planner(config(), PROFILE).decide(0.0, ClusterObservation(LOAD, fast)).prefill.replicas == 2
    )
    # ... but never judged faster while missing its SLO: back to 3
    missing = PoolObservation(workers("prefill", 1), slo_attainment=0.5, observed_latency_s=0.01)
    assert (
        Planner(config(), PROFILE).decide(0.0, ClusterObservation(LOAD, missing)).prefill.replicas
        == 3
    )


def test_decode_correction_uses_the_itl_at_the_current_batch() -> None:
    # 2 workers running 8 each: expected ITL 12.5 ms; observed 18.75 ms -> correction 1.5
    # 4,000 / (1,000 / 1.5 × 0.8) = 7.5 -> 8
    pool = PoolObservation(workers("decode", 2, running_requests=8), observed_latency_s=0.01875)
    decision = Planner(config(), PROFILE).decide(0.0, ClusterObservation(LOAD, decode=pool))
    assert decision.decode.replicas == 8
    assert "correction 1.50" in decision.decode.reason


def test_min_and_max_are_respected() -> None:
    idle = LoadSample(0.0, 0.0, 0.0)
    planner = Planner(config(), PROFILE)
    decision = planner.decide(0.0, cluster(0, 1, idle))
    assert decision.prefill.replicas == 1 and "below the minimum 1" in decision.prefill.reason
    assert not decision.decode.changed  # idle at the minimum: hold
    huge = LoadSample(1000.0, 1000.0, 200.0)
    assert Planner(config(), PROFILE).decide(0.0, cluster(1, 1, huge)).decode.replicas == 10
    over = Planner(config(), PROFILE).decide(0.0, cluster(12, 5))
    assert over.prefill.replicas == 10
    assert over.prefill.drain_first == ("prefill-0", "prefill-1")  # by id: all alike


def test_steps_are_limited_both_ways() -> None:
    up = Planner(config(step_up=2), PROFILE).decide(0.0, cluster(1, 1))
    assert (up.prefill.replicas, up.decode.replicas) == (3, 3)
    planner = Planner(config(scale_down_sustain_s=0.0, scale_down_cooldown_s=0.0), PROFILE)
    low = LoadSample(1.0, 1000.0, 200.0)  # needs 1 of each
    down = planner.decide(0.0, cluster(6, 6, low))
    assert (down.prefill.replicas, down.decode.replicas) == (5, 5)


def test_scale_up_cooldown_holds_then_allows() -> None:
    planner = Planner(config(step_up=2), PROFILE)
    assert planner.decide(0.0, cluster(1, 1)).decode.replicas == 3
    held = planner.decide(10.0, cluster(3, 3))
    assert not held.decode.changed and "scale-up cooldown, 20 s left" in held.decode.reason
    assert planner.decide(30.0, cluster(3, 3)).decode.replicas == 5


def test_scale_down_needs_a_sustained_fit_and_a_cooldown_after_any_change() -> None:
    planner = Planner(config(scale_down_sustain_s=60.0, scale_down_cooldown_s=120.0), PROFILE)
    assert planner.decide(0.0, cluster(1, 1)).decode.replicas == 5  # a change at 0 s
    # now 10 req/s: 2,000 output tokens/s fits 4 replicas with headroom (4 × 1,000 × 0.64)
    low = LoadSample(10.0, 1000.0, 200.0)
    assert "fits 4 for 0 of 60 s" in planner.decide(10.0, cluster(3, 5, low)).decode.reason
    assert "fits 4 for 59 of 60 s" in planner.decide(69.0, cluster(3, 5, low)).decode.reason
    held = planner.decide(70.0, cluster(3, 5, low)).decode
    assert not held.changed and "scale-down cooldown, 50 s left" in held.reason
    assert not planner.decide(119.0, cluster(3, 5, low)).decode.changed
    down = planner.decide(120.0, cluster(3, 5, low)).decode
    assert (down.current_replicas, down.replicas) == (5, 4)
    assert down.reason.endswith("fits 4 for 110 s") and down.drain_first == ("decode-0",)


def test_one_load_blip_restarts_the_scale_down_run() -> None:
    def down_times(loads: dict[float, LoadSample]) -> list[float]:
        planner = Planner(config(scale_down_sustain_s=30.0, scale_down_cooldown_s=0.0), PROFILE)
        low = LoadSample(10.0, 1000.0, 200.0)
        times = [float(t) for t in range(0, 130, 10)]
        return [
            t for t in times if planner.decide(t, cluster(3, 5, loads.get(t, low))).decode.changed
        ]

    # 2,000 output tokens/s fits 4 decode replicas: down after 30 s of it ...
    assert down_times({})[0] == 30.0
    # ... but one window at twice the load at 30 s restarts the run: the smoothed load fits
    # again from 50 s, so the pool shrinks at 80 s
    assert down_times({30.0: LoadSample(20.0, 1000.0, 200.0)})[0] == 80.0


def test_starting_replicas_count_until_their_start_up_time_is_overdue() -> None:
    planner = Planner(config(scale_up_cooldown_s=0.0), PROFILE)
    assert planner.decide(0.0, cluster(3, 1)).decode.replicas == 5
    arriving = workers("decode", 1) + workers("decode", 4, STARTING, since_s=0.0, first=1)
    obs = ClusterObservation(
        LOAD, PoolObservation(workers("prefill", 3)), PoolObservation(arriving)
    )
    held = planner.decide(10.0, obs)
    assert not held.decode.changed and "1 ready, 4 arriving" in held.decode.reason
    assert not planner.decide(30.0, obs).decode.changed  # 30 s = 1.5 × 20 s: still in time
    again = planner.decide(31.0, obs)  # overdue: their load is ordered again
    assert (again.decode.current_replicas, again.decode.replicas) == (5, 9)
    assert "4 overdue" in again.decode.reason


def test_spare_kv_under_10_percent_scales_up_at_once() -> None:
    small = LoadSample(1.0, 1000.0, 200.0)  # the forecast alone needs 1 of each
    planner = Planner(config(), PROFILE)
    full = PoolObservation(workers("decode", 2, kv_usage=0.95))
    decision = planner.decide(
        0.0, ClusterObservation(small, PoolObservation(workers("prefill", 1)), full)
    )
    assert decision.decode.replicas == 3 and "spare KV 5% < 10%" in decision.decode.reason
    # again 5 s later, still full (no scale-up cooldown for a fast signal) ...
    ready3 = PoolObservation(workers("decode", 3, kv_usage=0.95))
    assert planner.decide(5.0, ClusterObservation(small, decode=ready3)).decode.replicas == 4
    # ... but not while a replica is arriving: it brings the room
    arriving = PoolObservation(
        workers("decode", 3, kv_usage=0.95) + workers("decode", 1, STARTING, 5.0, 3)
    )
    held = planner.decide(10.0, ClusterObservation(small, decode=arriving))
    assert not held.decode.changed and "spare KV" in held.decode.reason


def test_queue_depth_over_threshold_scales_up_at_once() -> None:
    small = LoadSample(1.0, 1000.0, 200.0)
    queued = PoolObservation(workers("prefill", 2, waiting_requests=5))  # 10 waiting on 2 ready
    decision = Planner(config(), PROFILE).decide(0.0, ClusterObservation(small, queued))
    assert decision.prefill.replicas == 3
    assert "10 waiting on 2 ready (> 4 per replica)" in decision.prefill.reason
    calm = PoolObservation(workers("prefill", 2, waiting_requests=4))  # exactly 4 per replica
    assert (
        not Planner(config(), PROFILE).decide(0.0, ClusterObservation(small, calm)).prefill.changed
    )


def test_scale_in_drains_the_locality_cheapest_worker() -> None:
    planner = Planner(config(scale_down_sustain_s=0.0, scale_down_cooldown_s=0.0), PROFILE)
    decode = PoolObservation(
        (
            WorkerObservation(
                "decode-0", READY, running_requests=1, cached_blocks=90, unique_blocks=40
            ),
            WorkerObservation(
                "decode-1", READY, running_requests=6, cached_blocks=80, unique_blocks=3
            ),
            WorkerObservation(
                "decode-2", READY, running_requests=2, cached_blocks=70, unique_blocks=3
            ),
        )
    )
    decision = planner.decide(0.0, ClusterObservation(LoadSample(1.0, 100.0, 100.0), decode=decode))
    assert (decision.decode.replicas, decision.decode.drain_first) == (2, ("decode-2",))


def test_scale_down_waits_for_starting_replicas_and_for_the_slo() -> None:
    planner = Planner(config(scale_down_sustain_s=0.0, scale_down_cooldown_s=0.0), PROFILE)
    low = LoadSample(1.0, 1000.0, 200.0)
    starting = PoolObservation(workers("decode", 3) + workers("decode", 1, STARTING, 0.0, 3))
    assert not planner.decide(0.0, ClusterObservation(low, decode=starting)).decode.changed
    missing = PoolObservation(workers("decode", 4), slo_attainment=0.5)
    assert not planner.decide(1.0, ClusterObservation(low, decode=missing)).decode.changed
    met = PoolObservation(workers("decode", 4), slo_attainment=0.95)
    assert planner.decide(2.0, ClusterObservation(low, decode=met)).decode.replicas == 3


def test_decisions_are_deterministic_and_time_only_moves_forward() -> None:
    runs = []
    for _ in range(2):
        planner = Planner(config(), PROFILE)
        runs.append([planner.decide(t, cluster(2, 2)) for t in (0.0, 10.0, 20.0, 30.0)])
    assert runs[0] == runs[1]
    planner = Planner(config(), PROFILE)
    planner.decide(10.0, cluster(1, 1))
    with pytest.raises(ValueError, match="back in time"):
        planner.decide(5.0, cluster(1, 1))


def test_bad_configuration_is_rejected_with_the_values() -> None:
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        PoolLimits(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="max_step_up"):
        PoolLimits(max_step_up=0)
    with pytest.raises(ValueError, match="target_utilization"):
        PlannerConfig(target_utilization=1.6)
    with pytest.raises(ValueError, match="correction_min"):
        PlannerConfig(correction_min=1.2)
    with pytest.raises(ValueError, match="kv_usage"):
        WorkerObservation("decode-0", READY, kv_usage=1.5)
