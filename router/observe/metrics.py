"""The router's Prometheus metrics (``pdserve_*``), in a registry of its own per router.

Request-level figures are recorded as requests finish (``RouterMetrics.observe_*``). Figures
that belong to the fleet -- pool sizes, per-worker load and KV usage, the workers' own
counters, goodput -- are read at scrape time from a ``LiveSource`` by a custom collector.

Where each counter comes from:

| metric | source |
|---|---|
| ``pdserve_requests_total{outcome}`` | router: ok, error, cancelled (client gone), rejected |
| ``pdserve_prompt_tokens_total`` | router: prompts that got a first token |
| ``pdserve_generation_tokens_total`` | router: tokens streamed to clients |
| ``pdserve_kv_transfer_seconds_total`` | router: the prefill workers' transfer reports |
| ``pdserve_prefix_hit_tokens_total{worker}`` | prefill and colocated workers' GetStats |
| ``pdserve_kv_transfer_bytes_total{worker}`` | prefill workers' GetStats (sent, and fetched) |
| ``pdserve_kv_transfer_failures_total{worker}`` | prefill workers' GetStats |
| ``pdserve_recompute_fallbacks_total{worker}`` | every worker's GetStats |
| ``pdserve_router_link_bytes_per_second{prefill,decode}`` | router: transfer reports (gauge) |

Worker counters are accumulated since the router started (``pdserve.router.observe.worker_stats``),
so they never go down while the router runs, whatever the workers do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.router.observe.goodput import GoodputFigures, SloConfig, attainment_gauge, window_label
from pdserve.router.observe.worker_stats import WorkerSnapshot, WorkerTotals
from pdserve.router.request.types import RequestTiming

OUTCOMES = ("ok", "error", "cancelled", "rejected")
ROLES = ("prefill", "decode", "colocated")
PREFIX_HIT_ROLES = frozenset({"prefill", "colocated"})  # the roles that compute prompts
SENDER_ROLES = frozenset({"prefill"})  # decode workers count the same bytes as received
# From 1 ms (one decode step of a small model) to 5 minutes (a long generation end to end).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class LiveSource(Protocol):
    """What the scrape-time collector reads (``pdserve.router.observe.observability`` implements
    it)."""

    slo: SloConfig

    def pool_sizes(self) -> dict[str, int]: ...
    def worker_snapshots(self) -> Sequence[WorkerSnapshot]: ...
    def worker_up(self) -> dict[str, bool]: ...
    def worker_totals(self) -> Sequence[WorkerTotals]: ...
    def goodput(self) -> Sequence[GoodputFigures]: ...
    def link_rates(self) -> Mapping[tuple[str, str], float]: ...


class RouterMetrics:
    """Histograms and counters of one router, plus the live collector when given a source."""

    def __init__(self, live: LiveSource | None = None) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = _histogram("pdserve_ttft_seconds", "Time to first token.", reg)
        self.itl = _histogram(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive streamed chunks.", reg
        )
        self.e2e = _histogram("pdserve_e2e_seconds", "Arrival to last token.", reg)
        self.tpot = _histogram(
            "pdserve_tpot_seconds", "Time per output token after the first, per request.", reg
        )
        self.requests = Counter(
            "pdserve_requests", "Requests by outcome.", ["outcome"], registry=reg
        )
        # Every outcome is exposed, at 0 until it happens; the labelled children are kept
        # because ``labels()`` costs more than the increment it leads to.
        self._outcomes = {outcome: self.requests.labels(outcome) for outcome in OUTCOMES}
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of requests that got a first token.",
            registry=reg,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens streamed to clients.", registry=reg
        )
        self.kv_transfer_seconds = Counter(
            "pdserve_kv_transfer_seconds", "KV transfer time reported by prefill workers.",
            registry=reg,
        )  # fmt: skip
        if live is not None:
            reg.register(LiveCollector(live))

    def observe_outcome(self, outcome: str) -> None:
        child = self._outcomes.get(outcome)
        if child is None:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        child.inc()

    def observe_timing(self, timing: RequestTiming, tpot_s: float | None) -> None:
        """A successful request's latencies (``tpot_s`` None: one token, no TPOT)."""
        self.ttft.observe(timing.ttft_s)
        self.e2e.observe(timing.e2e_s)
        for gap_s in timing.itl_s:
            self.itl.observe(gap_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if timing.transfer_s > 0:
            self.kv_transfer_seconds.inc(timing.transfer_s)

    def totals(self) -> dict[str, Any]:
        """The router's own counters as plain numbers (for the dashboard's JSON)."""
        return {
            "requests": {o: _sample(self.requests, {"outcome": o}) for o in OUTCOMES},
            "prompt_tokens": _sample(self.prompt_tokens),
            "generation_tokens": _sample(self.generation_tokens),
            "kv_transfer_s": _sample(self.kv_transfer_seconds),
        }

    def exposition(self) -> bytes:
        """The Prometheus text format of everything in this router's registry."""
        return generate_latest(self.registry)


def _sample(counter: Counter, labels: dict[str, str] | None = None) -> float:
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == (labels or {}):
                return sample.value
    return 0.0


def _histogram(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, buckets=LATENCY_BUCKETS_S, registry=registry)


class LiveCollector(Collector):
    """Fleet and SLO figures read from a ``LiveSource`` at each scrape."""

    def __init__(self, source: LiveSource) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return []  # names are checked by tests; describing would call the source at register

    def collect(self) -> Iterable[Metric]:
        yield _pool_gauge(self.source.pool_sizes())
        yield from _worker_gauges(self.source.worker_snapshots(), self.source.worker_up())
        yield from _worker_counters(self.source.worker_totals())
        yield from _slo_gauges(self.source.slo, self.source.goodput())
        yield _link_gauge(self.source.link_rates())


def _pool_gauge(sizes: dict[str, int]) -> Metric:
    family = GaugeMetricFamily("pdserve_pool_workers", "Live workers by role.", labels=["role"])
    for role in sorted(set(ROLES) | set(sizes)):
        family.add_metric([role], sizes.get(role, 0))
    return family


def _link_gauge(rates: Mapping[tuple[str, str], float]) -> Metric:
    family = GaugeMetricFamily(
        "pdserve_router_link_bytes_per_second",
        "Measured KV transfer rate from a prefill to a decode worker (recent transfers).",
        labels=["prefill", "decode"],
    )
    for (prefill, decode), bytes_per_s in sorted(rates.items()):
        family.add_metric([prefill, decode], bytes_per_s)
    return family


_WORKER_GAUGES = (
    ("waiting", "Requests waiting in the worker's queue."),
    ("running", "Requests in the worker's running batch."),
    ("free_blocks", "Free KV blocks (including ones that still cache a prefix)."),
    ("cached_blocks", "KV blocks holding a cached prefix."),
    ("kv_usage", "Fraction of KV blocks in use, 0..1."),
)


def _worker_gauges(snapshots: Sequence[WorkerSnapshot], up: dict[str, bool]) -> Iterable[Metric]:
    up_family = GaugeMetricFamily(
        "pdserve_worker_up", "1 if the worker answered GetStats at this scrape.", labels=["worker"]
    )
    for worker_id, answered in sorted(up.items()):
        up_family.add_metric([worker_id], 1.0 if answered else 0.0)
    yield up_family
    for field_name, doc in _WORKER_GAUGES:
        family = GaugeMetricFamily(f"pdserve_worker_{field_name}", doc, labels=["worker", "role"])
        for snap in snapshots:
            value = snap.kv_usage if field_name == "kv_usage" else getattr(snap, field_name)
            if value is not None:
                family.add_metric([snap.worker_id, snap.role], float(value))
        yield family


# (metric name, WorkerCounters field, roles counted, help)
_WORKER_COUNTERS = (
    ("pdserve_prefix_hit_tokens", "prefix_hit_tokens", PREFIX_HIT_ROLES,
     "Prompt tokens whose KV came from a worker's prefix cache."),
    ("pdserve_kv_transfer_bytes", "transfer_bytes", SENDER_ROLES,
     "KV bytes prefill workers sent, and fetched from peers."),
    ("pdserve_kv_transfer_failures", "transfers_failed", SENDER_ROLES,
     "KV transfers that failed."),
    ("pdserve_recompute_fallbacks", "recompute_fallbacks", frozenset(ROLES),
     "Prompt prefixes computed because fetching them from a peer failed."),
)  # fmt: skip


def _worker_counters(totals: Sequence[WorkerTotals]) -> Iterable[Metric]:
    for name, field_name, roles, doc in _WORKER_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["worker"])
        for total in totals:
            if total.role in roles:
                family.add_metric([total.worker_id], float(getattr(total.counters, field_name)))
        yield family


def _slo_gauges(slo: SloConfig, figures: Sequence[GoodputFigures]) -> Iterable[Metric]:
    goodput = GaugeMetricFamily(
        "pdserve_goodput_rps",
        "Requests/s that met both the TTFT and the TPOT target, per window.",
        labels=["window"],
    )
    for f in figures:
        goodput.add_metric([window_label(f.window_s)], f.goodput_rps)
    yield goodput
    attainment = GaugeMetricFamily(
        "pdserve_slo_attainment",
        "Fraction of requests meeting both targets, per window (NaN: no requests).",
        labels=["window"],
    )
    for label, value in attainment_gauge(figures):
        attainment.add_metric([label], value)
    yield attainment
    yield GaugeMetricFamily("pdserve_slo_ttft_seconds", "The TTFT target.", value=slo.ttft_s)
    yield GaugeMetricFamily("pdserve_slo_tpot_seconds", "The TPOT target.", value=slo.tpot_s)
