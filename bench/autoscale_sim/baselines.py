"""The autoscaling policies compared; fixed provisioning is ``autoscaler=None``.

* :class:`PlannerAutoscaler`: pdserve's planner itself (``pdserve.cluster.autoscale``),
  every 10 s, on what the router's goodput windows publish (the last 10 s of finished
  requests) and each worker's state; scale-in drains the workers it names.
* :class:`ReactiveAutoscaler`: like llm-d's workload variant autoscaler (saturation
  analyzer, its default thresholds), per pool on its own, one replica per 60 s interval.
* :class:`ThroughputAutoscaler`: like Dynamo's throughput planner (its sizing and
  correction factors), every 180 s; no drain, and no start-up time in its arithmetic.
"""

from __future__ import annotations

import dataclasses
import math

from pdserve.bench.autoscale_sim.engine import Action, Simulation
from pdserve.bench.autoscale_sim.model import CostModel, Slo
from pdserve.bench.autoscale_sim.workers import (
    DRAINING,
    READY,
    STARTING,
    DecodeWorker,
    PrefillWorker,
    Worker,
)
from pdserve.cluster.autoscale import (
    CapacityProfile,
    ClusterObservation,
    HoltForecaster,
    LoadSample,
    Planner,
    PlannerConfig,
    PoolLimits,
    PoolObservation,
    WorkerObservation,
)
from pdserve.cluster.pool_manager import MemberState

POOLS = ("prefill", "decode")
_STATES = {STARTING: MemberState.STARTING, READY: MemberState.READY, DRAINING: MemberState.DRAINING}


def load_of(sim: Simulation, worker: Worker, now: float) -> tuple[int, int, float]:
    """(running, waiting, KV usage) as the worker's stats would report them."""
    if isinstance(worker, PrefillWorker):
        return worker.running(now), worker.waiting(now), worker.kv_usage(now, sim.cost)
    assert isinstance(worker, DecodeWorker)
    return worker.running, len(worker.waiting), worker.kv_usage(sim.cost)


def planner_limits(fixed: dict[str, int], budget: float = 2.0) -> dict[str, PoolLimits]:
    """Each pool up to ``budget`` × its fixed-peak size (a worker budget, as Dynamo's or an
    HPA's maximum); steps in the defaults' proportions (``PoolLimits()``: up 2 and down 1 of
    at most 8 replicas) of twice the fixed-peak size, whatever the budget."""
    limits = {}
    for role in POOLS:
        steps_of = 2 * fixed[role]
        most = max(1, round(budget * fixed[role]))
        limits[role] = PoolLimits(1, most, max(2, steps_of // 4), max(1, steps_of // 8))
    return limits


class PlannerAutoscaler:
    """``load="goodput"``: the load as the router's goodput windows publish it (finished
    requests, and refused attempts with the tokens they asked for). ``load="arrivals"``: the
    requests arriving at the router (first attempts) and their prompt lengths, with the
    mean output of the requests finished (known only at the end)."""

    name = "pdserve planner"

    def __init__(
        self,
        profile: CapacityProfile,
        limits: dict[str, PoolLimits],
        interval_s: float = 10.0,
        window_s: float = 10.0,
        load: str = "goodput",
        target_utilization: float | None = None,
        scale_down_sustain_s: float | None = None,
    ) -> None:
        """``target_utilization``, ``scale_down_sustain_s``: the planner's operating point
        (None: its defaults)."""
        config = PlannerConfig(prefill=limits["prefill"], decode=limits["decode"])
        if target_utilization is not None:
            config = dataclasses.replace(config, target_utilization=target_utilization)
        if scale_down_sustain_s is not None:
            config = dataclasses.replace(config, scale_down_sustain_s=scale_down_sustain_s)
        self.planner = Planner(config, profile)
        self.interval_s, self.window_s, self.load = interval_s, window_s, load
        self._output_mean = 0.0

    def _load(self, now: float, sim: Simulation) -> LoadSample:
        w = sim.recorder.window(now, self.window_s)
        served = w.requests - w.failed  # the goodput window's token rates count these only
        if self.load == "goodput":
            return LoadSample.from_rates(
                w.request_rate,
                (served * w.mean_input + w.refused_input_tokens) / w.seconds,
                (served * w.mean_output + w.refused_output_tokens) / w.seconds,
            )
        if served:
            self._output_mean = w.mean_output
        rate, input_mean = sim.recorder.arrivals(now, self.window_s)
        return LoadSample(rate, input_mean, self._output_mean if rate else 0.0)

    def observe(self, now: float, sim: Simulation) -> ClusterObservation:
        w = sim.recorder.window(now, self.window_s)
        load = self._load(now, sim)

        def pool(role: str, attainment: float | None, latency: float | None) -> PoolObservation:
            workers = []
            for x in sim.cluster.pools[role]:
                running, waiting, kv = load_of(sim, x, now)
                since = x.ready_s if x.state == READY else x.ordered_s
                workers.append(
                    WorkerObservation(
                        x.worker_id, _STATES[x.state], since, running, waiting, min(1.0, kv)
                    )
                )
            return PoolObservation(tuple(workers), attainment, latency)

        return ClusterObservation(
            load,
            pool("prefill", w.ttft_attainment, w.ttft_mean),
            pool("decode", w.tpot_attainment, w.tpot_mean),
        )

    def decide(self, now: float, sim: Simulation) -> list[Action]:
        decision = self.planner.decide(now, self.observe(now, sim))
        actions = []
        for d in (decision.prefill, decision.decode):
            if d.replicas > d.current_replicas:
                actions.append(Action(d.role, start=d.replicas - d.current_replicas))
            elif d.replicas < d.current_replicas:
                actions.append(Action(d.role, remove=d.drain_first))
        return actions


class ReactiveAutoscaler:
    """Saturation: a ready replica is saturated at KV >= 80% or >= 5 waiting (peaks since
    the last decision, as ``max_over_time[1m]``); up one when the non-saturated replicas'
    mean spare KV < 10% or spare queue < 3 (none starting); down one (drained) when the
    load spread over one replica fewer keeps both spares."""

    name = "reactive (llm-d-like)"

    def __init__(
        self,
        interval_s: float = 60.0,
        kv_threshold: float = 0.8,
        queue_threshold: int = 5,
        kv_spare: float = 0.1,
        queue_spare: float = 3.0,
    ) -> None:
        self.interval_s = interval_s
        self.kv_threshold, self.queue_threshold = kv_threshold, queue_threshold
        self.kv_spare, self.queue_spare = kv_spare, queue_spare

    def decide(self, now: float, sim: Simulation) -> list[Action]:
        actions = []
        for role in POOLS:
            workers = sim.cluster.pools[role]
            ready = [w for w in workers if w.state == READY]
            peaks = []
            for w in ready:
                _, waiting, kv = load_of(sim, w, now)
                peaks.append((max(kv, w.kv_peak), max(waiting, w.queue_peak)))
                w.kv_peak, w.queue_peak = kv, waiting
            fit = [
                (kv, q) for kv, q in peaks if kv < self.kv_threshold and q < self.queue_threshold
            ]
            up = not fit or (
                sum(self.kv_threshold - kv for kv, _ in fit) / len(fit) < self.kv_spare
                or sum(self.queue_threshold - q for _, q in fit) / len(fit) < self.queue_spare
            )
            if up and not any(w.state == STARTING for w in workers):
                actions.append(Action(role, start=1))
            elif not up and len(fit) >= 2 and self._fits_fewer(fit):
                actions.append(Action(role, remove=(ready[-1].worker_id,)))  # the newest
        return actions

    def _fits_fewer(self, fit: list[tuple[float, int]]) -> bool:
        n = len(fit) - 1
        kv = self.kv_threshold - sum(k for k, _ in fit) / n
        queue = self.queue_threshold - sum(q for _, q in fit) / n
        return kv >= self.kv_spare and queue >= self.queue_spare


class ThroughputAutoscaler:
    """prefill = predicted input tokens/s × min(1, TTFT correction) ÷ prefill tokens/s at
    the predicted prompt length; decode = predicted output tokens/s ÷ the best decode
    tokens/s at ITL SLO ÷ ITL correction. Removed replicas are killed, newest first."""

    name = "throughput (Dynamo-like)"

    def __init__(
        self,
        cost: CostModel,
        slo: Slo,
        budget: int,
        interval_s: float = 180.0,
        min_endpoint: int = 1,
        drain: bool = False,
        utilization: float = 1.0,
    ) -> None:
        self.cost, self.slo, self.budget = cost, slo, budget
        self.interval_s, self.min_endpoint = interval_s, min_endpoint
        self.drain = drain  # Dynamo's planner does not drain; True only to compare
        self.utilization = utilization  # 1: Dynamo's sizing; < 1 adds headroom (to compare)
        self._rate, self._isl, self._osl = (HoltForecaster() for _ in range(3))

    def decide(self, now: float, sim: Simulation) -> list[Action]:
        w = sim.recorder.window(now, self.interval_s)
        served = w.requests - w.failed
        if not served or w.ttft_mean is None or w.tpot_mean is None:
            return []  # no traffic: no adjustment
        num_req = w.requests  # requests_total counts every answered request, errors too
        cost, interval = self.cost, self.interval_s
        ready_decode = max(1, sim.cluster.count("decode", READY))
        p_corr = w.ttft_mean / cost.prefill_s(w.mean_input)
        concurrency = num_req / ready_decode * (w.duration_mean or 0.0) / interval
        expect_itl = cost.itl_s(max(1.0, concurrency), w.mean_input + w.mean_output / 2)
        d_corr = w.tpot_mean / expect_itl
        for f, x in ((self._rate, num_req), (self._isl, w.mean_input), (self._osl, w.mean_output)):
            f.observe(now, x)
        num, isl, osl = (max(1.0, f.predict(interval)) for f in (self._rate, self._isl, self._osl))
        prefill_tps = num * isl / interval * min(1.0, p_corr)
        u = self.utilization
        p = math.ceil(prefill_tps / (cost.prefill_rate_at(isl) * u) - 1e-9)
        itl = self.slo.tpot_s / d_corr if d_corr > 0 else self.slo.tpot_s
        d = math.ceil(num * osl / interval / (cost.decode_rate_at_slo(isl, osl, itl) * u) - 1e-9)
        p, d = max(p, self.min_endpoint), max(d, self.min_endpoint)
        if p + d > self.budget:
            scale = self.budget / (p + d)
            p = max(self.min_endpoint, round(p * scale))
            d = max(self.min_endpoint, self.budget - p)
        return [self._to(sim, "prefill", p), self._to(sim, "decode", d)]

    def _to(self, sim: Simulation, role: str, target: int) -> Action:
        workers = sim.cluster.pools[role]
        active = [x for x in workers if x.state in (STARTING, READY)]
        if target >= len(active):
            return Action(role, start=target - len(active))
        newest = sorted(active, key=lambda x: (x.state == READY, -x.ordered_s))
        victims = tuple(x.worker_id for x in newest[: len(active) - target])
        return Action(role, remove=victims, drain=self.drain)
