"""The autoscaler at work: the cluster read from Redis, the planner's decision, an actuator.

Each tick::

    routers' goodput windows (slo:router:*)  -> load: requests/s, prompt and output tokens/s,
                                                SLO attainment
    worker registry                          -> each worker's running, waiting, KV usage
    pool members + locality index            -> state and since when; unique cached blocks
        -> Planner.decide -> actuator.scale(pool, n) for the pools that changed
        -> pdserve_planner_desired_replicas{pool}

`pdserve up --autoscale` runs it inside its supervising loop over the Ray pools (their
members are known there); `pdserve planner` runs it alone (on Kubernetes), where a pool's
members are its registered workers plus the replicas ordered and not registered yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from pdserve.cluster.actuators import POOLS, Actuator
from pdserve.cluster.autoscale import (
    CapacityProfile,
    ClusterObservation,
    LoadSample,
    Planner,
    PlannerConfig,
    PlannerDecision,
    PoolObservation,
    WorkerObservation,
)
from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.pool_manager import MemberState, PoolMember
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto.workers import WorkerInfo
from pdserve.router.observe.goodput_store import StoredGoodput, read_goodput

log = logging.getLogger("pdserve.autoscale")

# role -> its members (state and since when), given the registered workers: the Ray pools
# know theirs; without an orchestrator to ask, they are the registered ones plus those ordered.
MembersFn = Callable[[Sequence[WorkerInfo]], Mapping[str, Sequence[PoolMember]]]


@dataclass(slots=True, frozen=True)
class AutoscaleSettings:
    """The planner's settings and profile, the goodput window it reads the load from, and
    where ``pdserve_planner_*`` are served (``metrics_port`` None: not served; 0: any)."""

    planner: PlannerConfig
    profile: CapacityProfile
    window: str = "10s"
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


@dataclass(slots=True, frozen=True)
class RouterLoad:
    """The routers' figures of one window, summed over routers."""

    load: LoadSample
    slo_attainment: float | None
    ttft_s: float | None = None  # mean over the requests served, weighted by router
    tpot_s: float | None = None


def router_load(goodput: Sequence[StoredGoodput], window: str) -> RouterLoad:
    """Rates add up over routers; attainment is good over all requests (pure).

    A router younger than the window divides by the time it has been up: its first requests
    look like a burst. Here every rate is over the whole window instead, so a router that
    just started reads low (the load shows as the window fills), never high.
    """
    rps = prompt_tps = output_tps = 0.0
    requests = good = 0
    ttft = _WeightedMean()
    tpot = _WeightedMean()
    window_s = float(window.removesuffix("s"))
    for router in goodput:
        for w in router.windows:
            if w.window == window:
                share = min(1.0, w.span_s / window_s) if w.span_s > 0 else 1.0
                rps += w.request_rps * share
                prompt_tps += w.prompt_tokens_per_s * share
                output_tps += w.output_tokens_per_s * share
                requests += w.requests
                good += w.good_requests
                ttft.add(w.ttft_mean_s, w.requests)
                tpot.add(w.tpot_mean_s, w.requests)
    attainment = good / requests if requests else None
    load = LoadSample.from_rates(rps, prompt_tps, output_tps)
    return RouterLoad(load, attainment, ttft.value, tpot.value)


@dataclass(slots=True)
class _WeightedMean:
    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float | None, weight: float) -> None:
        if value is not None and weight > 0:
            self.total += value * weight
            self.weight += weight

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight else None


def worker_observation(
    member: PoolMember, info: WorkerInfo | None, unique_blocks: int = 0
) -> WorkerObservation:
    """One member as the planner sees it; a member not registered yet reports no load."""
    if info is None:
        return WorkerObservation(member.worker_id, member.state, member.since_s)
    extra = dict(info.load.extra)
    return WorkerObservation(
        member.worker_id,
        member.state,
        member.since_s,
        running_requests=info.load.running,
        waiting_requests=info.load.waiting,
        kv_usage=min(1.0, max(0.0, extra.get("kv_usage", 0.0))),
        cached_blocks=int(extra.get("cached_blocks", 0)),
        unique_blocks=unique_blocks,
    )


def cluster_observation(
    load: RouterLoad,
    members: Mapping[str, Sequence[PoolMember]],
    workers: Sequence[WorkerInfo],
    unique: Mapping[str, int] | None = None,
) -> ClusterObservation:
    """The planner's input from the routers' load, the pools' members, the registry and each
    worker's unique cached blocks (the locality index)."""
    by_id = {w.worker_id: w for w in workers}
    unique = unique or {}

    def pool(role: str, latency_s: float | None) -> PoolObservation:
        observed = tuple(
            worker_observation(m, by_id.get(m.worker_id), unique.get(m.worker_id, 0))
            for m in members[role]
        )
        return PoolObservation(observed, load.slo_attainment, latency_s)

    # Prefill answers for the time to first token, decode for the time per output token.
    return ClusterObservation(load.load, pool("prefill", load.ttft_s), pool("decode", load.tpot_s))


@dataclass(slots=True)
class OrderedReplicas:
    """A pool's members without an orchestrator to ask: its registered workers, READY, plus
    one STARTING placeholder per replica ordered beyond them, starting since the last time
    an order grew (``refresh`` reads the orders from the actuator)."""

    actuator: Actuator
    counts: dict[str, int] = field(default_factory=dict)
    since_s: float = 0.0

    def refresh(self, now_s: float) -> None:
        counts = {pool: self.actuator.replicas(pool) for pool in POOLS}
        if any(counts[p] > self.counts.get(p, 0) for p in POOLS):
            self.since_s = now_s
        self.counts = counts

    def members(self, workers: Sequence[WorkerInfo]) -> dict[str, list[PoolMember]]:
        members: dict[str, list[PoolMember]] = {}
        for role in POOLS:
            ids = [w.worker_id for w in workers if w.role.value == role]
            members[role] = [PoolMember(wid, i, MemberState.READY) for i, wid in enumerate(ids)]
            for i in range(len(ids), self.counts.get(role, 0)):
                placeholder = f"{role}-ordered-{i}"
                members[role].append(
                    PoolMember(placeholder, i, MemberState.STARTING, 0, self.since_s)
                )
        return members


class Autoscaler:
    """One planner, one actuator, and where the cluster's state comes from.

    ``observe(now_s)`` builds the planner's input (see :class:`RedisClusterView`); ``tick``
    decides and acts. Not thread-safe: tick from one thread.
    """

    def __init__(
        self,
        planner: Planner,
        actuator: Actuator,
        observe: Callable[[float], ClusterObservation],
        on_decision: Callable[[PlannerDecision], None] | None = None,
    ) -> None:
        self.planner = planner
        self.actuator = actuator
        self._observe = observe
        self._on_decision = on_decision

    def tick(self, now_s: float) -> PlannerDecision:
        decision = self.planner.decide(now_s, self._observe(now_s))
        for pool in (decision.prefill, decision.decode):
            if pool.changed:
                log.info(
                    "autoscale %s: %d -> %d (%s)",
                    pool.role,
                    pool.current_replicas,
                    pool.replicas,
                    pool.reason,
                )
                self.actuator.scale(pool.role, pool.replicas, pool.drain_first)
        if self._on_decision is not None:
            self._on_decision(decision)
        return decision


class RedisClusterView:
    """The planner's input read from one Redis: routers' goodput, the registry, the index
    (one round trip each, per tick)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        registry: WorkerRegistry,
        index: LocalityIndex,
        members: MembersFn,
        window: str = "10s",
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._registry = registry
        self._index = index
        self._members = members
        self.window = window

    def __call__(self, now_s: float) -> ClusterObservation:
        load = router_load(read_goodput(self._client, self._prefix), self.window)
        workers = self._registry.list_workers()
        members = self._members(workers)
        unique: dict[str, int] = {}
        for pool in members.values():
            unique |= self._index.unique_blocks([m.worker_id for m in pool])
        return cluster_observation(load, members, workers, unique)


class PlannerMetrics:
    """``pdserve_planner_*`` in a registry of their own (HPA or KEDA may act on them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.desired = Gauge(
            "pdserve_planner_desired_replicas",
            "Replicas the planner wants per pool (ready + starting).",
            ["pool"],
            registry=self.registry,
        )
        self.current = Gauge(
            "pdserve_planner_current_replicas",
            "Replicas of each pool when the planner last decided.",
            ["pool"],
            registry=self.registry,
        )
        self.forecast_rps = Gauge(
            "pdserve_planner_forecast_requests_per_second",
            "The load the planner sized the pools for (requests/s at now + start-up time).",
            registry=self.registry,
        )
        self.changes = Counter(
            "pdserve_planner_changes",
            "Decisions that changed a pool's size, by direction.",
            ["pool", "direction"],
            registry=self.registry,
        )

    def record(self, decision: PlannerDecision) -> None:
        self.forecast_rps.set(decision.forecast.request_rate_per_s)
        for pool in (decision.prefill, decision.decode):
            self.desired.labels(pool.role).set(pool.replicas)
            self.current.labels(pool.role).set(pool.current_replicas)
            if pool.changed:
                direction = "up" if pool.replicas > pool.current_replicas else "down"
                self.changes.labels(pool.role, direction).inc()

    def serve(self, host: str, port: int) -> int:
        """Serve ``GET /metrics`` on ``host:port`` (0: a free port) in a thread; the port."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return int(server.server_port)


def build_autoscaler(
    settings: AutoscaleSettings,
    actuator: Actuator,
    observe: Callable[[float], ClusterObservation],
) -> Autoscaler:
    """A planner over ``observe`` acting through ``actuator``, its metrics served when the
    settings give a port."""
    metrics = PlannerMetrics()
    if settings.metrics_port is not None:
        port = metrics.serve(settings.metrics_host, settings.metrics_port)
        log.info("planner metrics at http://%s:%d/metrics", settings.metrics_host, port)
    planner = Planner(settings.planner, settings.profile)
    return Autoscaler(planner, actuator, observe, metrics.record)
