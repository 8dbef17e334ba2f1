"""The autoscaler's wiring, without Redis: routers' figures -> load, members -> the
planner's workers, orders -> starting placeholders, decisions -> metrics and actions."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest

from pdserve.cluster.actuators import Actuator, MetricsOnlyActuator
from pdserve.cluster.autoscale import (
    CapacityProfile,
    ClusterObservation,
    DecodePoint,
    LoadSample,
    Planner,
    PlannerConfig,
    PoolLimits,
)
from pdserve.cluster.autoscaler import (
    Autoscaler,
    OrderedReplicas,
    PlannerMetrics,
    RouterLoad,
    cluster_observation,
    router_load,
)
from pdserve.cluster.cli_profile import decode_point, prefill_rate
from pdserve.cluster.pool_manager import MemberState, PoolMember
from pdserve.engine.engine import StepRecord
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole
from pdserve.router.observe.goodput_store import StoredGoodput, StoredWindow


def _router(router_id: str, **w10: float) -> StoredGoodput:
    ten = StoredWindow("10s", int(w10["requests"]), int(w10["good"]), w10["rps"], 0.0, None,
                       w10["prompt_tps"], w10["output_tps"], 10.0, w10.get("ttft"),
                       w10.get("tpot"))  # fmt: skip
    sixty = StoredWindow("60s", 999, 0, 99.0, 0.0, None, 9e6, 9e6)
    return StoredGoodput(router_id, 0, 1000.0, 100.0, (ten, sixty))


def test_router_load_adds_rates_and_pools_attainment() -> None:
    routers = [
        _router("a", requests=30, good=27, rps=3.0, prompt_tps=600.0, output_tps=90.0,
                ttft=0.2, tpot=0.05),
        _router("b", requests=10, good=5, rps=1.0, prompt_tps=400.0, output_tps=10.0,
                ttft=0.6),
    ]  # fmt: skip
    load = router_load(routers, "10s")
    assert load.load == LoadSample(4.0, 250.0, 25.0)  # per request: 1000/4 in, 100/4 out
    assert load.slo_attainment == pytest.approx(32 / 40)
    assert load.ttft_s == pytest.approx((30 * 0.2 + 10 * 0.6) / 40)  # weighted by requests
    assert load.tpot_s == pytest.approx(0.05)  # router b had no TPOT
    assert router_load([], "10s") == RouterLoad(LoadSample(0.0, 0.0, 0.0), None)


def test_a_router_younger_than_the_window_reads_low_not_high() -> None:
    # Up for 2 s of a 10 s window, it divided 2 requests by 2 s: 1 request/s.
    young = StoredWindow("10s", 2, 2, 1.0, 1.0, 1.0, 50.0, 10.0, span_s=2.0)
    load = router_load([StoredGoodput("r", 0, 1000.0, 100.0, (young,))], "10s")
    assert load.load.request_rate_per_s == pytest.approx(0.2)  # 2 requests over 10 s
    assert load.load.input_tokens_per_s == pytest.approx(10.0)


def test_cluster_observation_joins_members_with_the_registry() -> None:
    members = {
        "prefill": [PoolMember("p0", 0, MemberState.READY, 0, 5.0)],
        "decode": [
            PoolMember("d0", 0, MemberState.READY, 1, 1.0),
            PoolMember("d1", 1, MemberState.STARTING, 0, 9.0),  # not registered yet
        ],
    }
    load = WorkerLoad(waiting=3, running=2, free_blocks=10,
                      extra=(("cached_blocks", 40.0), ("kv_usage", 0.75)))  # fmt: skip
    workers = [WorkerInfo("p0", WorkerRole.PREFILL, "h:1", load=load)]
    router = RouterLoad(LoadSample(1.0, 2.0, 3.0), 0.5, ttft_s=0.4, tpot_s=0.08)
    observed = cluster_observation(router, members, workers, unique={"p0": 7})
    (p0,) = observed.prefill.workers
    assert (p0.state, p0.since_s, p0.running_requests, p0.waiting_requests) == (
        MemberState.READY,
        5.0,
        2,
        3,
    )
    assert (p0.kv_usage, p0.cached_blocks, p0.unique_blocks) == (0.75, 40, 7)
    assert [w.worker_id for w in observed.decode.workers] == ["d0", "d1"]
    assert observed.decode.workers[1].state is MemberState.STARTING
    assert observed.prefill.slo_attainment == observed.decode.slo_attainment == 0.5
    assert (observed.prefill.observed_latency_s, observed.decode.observed_latency_s) == (0.4, 0.08)


def test_ordered_replicas_stand_in_for_workers_still_starting() -> None:
    actuator = MetricsOnlyActuator(initial=1)
    ordered = OrderedReplicas(actuator)
    ordered.refresh(10.0)
    actuator.scale("decode", 3)
    ordered.refresh(20.0)  # two more decode replicas ordered at 20 s
    workers = [WorkerInfo("d-a", WorkerRole.DECODE, "h:1"), WorkerInfo("p-a", "prefill", "h:2")]
    members = ordered.members(workers)
    assert [(m.worker_id, m.state, m.since_s) for m in members["decode"]] == [
        ("d-a", MemberState.READY, 0.0),
        ("decode-ordered-1", MemberState.STARTING, 20.0),
        ("decode-ordered-2", MemberState.STARTING, 20.0),
    ]
    assert [m.worker_id for m in members["prefill"]] == ["p-a"]
    ordered.refresh(30.0)  # no new order: the placeholders keep their start time
    assert ordered.since_s == 20.0


def test_metrics_only_actuator_refuses_other_pools() -> None:
    actuator = MetricsOnlyActuator()
    assert isinstance(actuator, Actuator)
    with pytest.raises(ValueError, match=r"pool must be one of \['prefill', 'decode'\]"):
        actuator.scale("colocated", 2)
    with pytest.raises(ValueError, match="pool must be one of"):
        actuator.replicas("colocated")
    with pytest.raises(ValueError, match="replicas must be >= 0, got -1 for the decode pool"):
        actuator.scale("decode", -1)
    actuator.scale("decode", 3)
    assert (actuator.replicas("decode"), actuator.replicas("prefill")) == (3, 1)


PROFILE = CapacityProfile(
    1000.0, (DecodePoint(1, 50.0, 0.02), DecodePoint(8, 200.0, 0.04)), 8, 10.0
)


def test_a_tick_scales_the_changed_pool_and_exports_the_decision() -> None:
    limits = PoolLimits(1, 6, max_step_up=5)
    planner = Planner(PlannerConfig(prefill=limits, decode=limits), PROFILE)
    actuator = MetricsOnlyActuator(initial=1)
    metrics = PlannerMetrics()
    one = {role: [PoolMember(f"{role}-0", 0, MemberState.READY)] for role in ("prefill", "decode")}
    # 4 requests/s of 100 prompt and 100 output tokens: 400 output tokens/s need
    # ceil(400 / (200 * 0.8)) = 3 decode workers; 400 prompt tokens/s fit one prefill worker.
    busy = RouterLoad(LoadSample(4.0, 100.0, 100.0), 1.0)

    def observe(now_s: float) -> ClusterObservation:
        return cluster_observation(busy, one, [])

    autoscaler = Autoscaler(planner, actuator, observe, metrics.record)
    decision = autoscaler.tick(0.0)
    for now_s in range(5, 40, 5):  # the forecaster needs a few samples
        if decision.changed:
            break
        decision = autoscaler.tick(float(now_s))
    assert (decision.decode.current_replicas, decision.decode.replicas) == (1, 3)
    assert not decision.prefill.changed
    assert actuator.replicas("decode") == 3 and actuator.replicas("prefill") == 1
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_planner_desired_replicas{pool="decode"} 3.0' in text
    assert 'pdserve_planner_changes_total{direction="up",pool="decode"} 1.0' in text


class _RecordingActuator(MetricsOnlyActuator):
    def __init__(self, initial: int) -> None:
        super().__init__(initial)
        self.calls: list[tuple[str, int, tuple[str, ...]]] = []

    def scale(self, pool: str, replicas: int, remove: Sequence[str] = ()) -> None:
        self.calls.append((pool, replicas, tuple(remove)))
        super().scale(pool, replicas, remove)


def test_a_scale_in_names_the_workers_to_remove() -> None:
    # No load and no scale-down delays: the decode pool shrinks by one, and the actuator is
    # told which worker goes: the one whose cache is least held elsewhere, then least busy.
    limits = PoolLimits(1, 6)
    config = PlannerConfig(prefill=limits, decode=limits, scale_down_sustain_s=0.0,
                           scale_down_cooldown_s=0.0)  # fmt: skip
    actuator = _RecordingActuator(initial=3)
    members = {
        "prefill": [PoolMember("p0", 0, MemberState.READY)],
        "decode": [PoolMember(f"d{i}", i, MemberState.READY) for i in range(3)],
    }
    workers = [WorkerInfo(f"d{i}", WorkerRole.DECODE, f"h:{i}",
                          load=WorkerLoad(running=n)) for i, n in enumerate((0, 2, 1))]  # fmt: skip
    unique = {"d0": 9, "d1": 0, "d2": 0}
    idle = RouterLoad(LoadSample(0.0, 0.0, 0.0), None)
    planner = Planner(config, PROFILE)
    autoscaler = Autoscaler(
        planner, actuator, lambda now_s: cluster_observation(idle, members, workers, unique)
    )
    decision = autoscaler.tick(0.0)
    assert (decision.decode.current_replicas, decision.decode.replicas) == (3, 2)
    assert actuator.calls == [("decode", 2, ("d2",))]


def _step(chunks: list[tuple[int, int]], step_s: float) -> StepRecord:
    plan = BatchPlan(tuple(
        ScheduledChunk(f"s{i}", tuple(range(n)), start, (0,), True)
        for i, (n, start) in enumerate(chunks)
    ))  # fmt: skip
    return StepRecord(plan, None, step_s)  # type: ignore[arg-type]


def test_profile_reads_prefill_and_decode_steps_apart() -> None:
    records = [
        _step([(512, 0)], 0.5),  # prefill
        _step([(256, 512)], 0.25),  # a later chunk of the same prompt: prefill too
        _step([(1, 512), (1, 40)], 0.02),  # decode of 2
        _step([(1, 513), (1, 41)], 0.04),
        _step([(1, 514), (1, 42)], 0.03),
        _step([(1, 515)], 0.01),  # decode of 1
        _step([(1, 516), (64, 0)], 0.3),  # mixed: neither
    ]
    assert prefill_rate(records) == pytest.approx(768 / 0.75)
    point = decode_point(records, 2)
    assert (point.batch_size, point.itl_s, point.tokens_per_s) == (2, 0.03, pytest.approx(2 / 0.03))
    with pytest.raises(ValueError, match="no decode step ran 4 sequences"):
        decode_point(records, 4)
