"""A worker process's own Prometheus endpoint: its ``GetStats`` figures, read at scrape time.

``start_metrics_server(port, stats_fn)`` serves ``/metrics`` from a thread. Each scrape
calls ``stats_fn()`` -- the same ``worker_pb2.WorkerStats`` the worker answers ``GetStats``
with -- so nothing is copied or cached between scrapes. A worker whose stats live on an
asyncio loop passes ``stats_fn_on_loop(async_fn, loop)``.

Names: per-worker gauges match the router's re-exports (``pdserve_worker_waiting{worker,
role}`` ...), so a dashboard can take ``max by (worker)`` over either source. The worker's
counters are ``pdserve_worker_*_total``: the router's fleet counters
(``pdserve_prefix_hit_tokens_total`` ...) cover the same events, and distinct names keep a
``sum()`` over every scraped job from counting them twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.proto import worker_pb2

log = logging.getLogger(__name__)

StatsFn = Callable[[], worker_pb2.WorkerStats]

_GAUGES = (
    ("waiting", "Requests waiting in the worker's queue."),
    ("running", "Requests in the worker's running batch."),
    ("free_blocks", "Free KV blocks (including ones that still cache a prefix)."),
    ("cached_blocks", "KV blocks holding a cached prefix."),
    ("total_blocks", "KV blocks in the worker's pool."),
)
# (metric name after "pdserve_worker_", WorkerStats field, help)
_COUNTERS = (
    ("prefix_hit_tokens", "prefix_hit_tokens", "Prompt tokens whose KV came from the cache."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of requests accepted (imported too)."),
    ("generated_tokens", "generated_tokens", "Tokens this worker sampled."),
    ("kv_transfer_bytes", "transfer_bytes", "KV bytes sent plus received."),
    (
        "recompute_fallbacks",
        "recompute_fallbacks",
        "Peer fetches that failed: the prompt prefix was computed instead.",
    ),
    ("spec_verify_steps", "spec_verify_steps", "Speculative verify chunks run."),
    ("spec_proposed_tokens", "spec_proposed_tokens", "Speculated candidate tokens verified."),
    ("spec_accepted_tokens", "spec_accepted_tokens", "Speculated candidate tokens accepted."),
    (
        "spec_branch_accepted_tokens",
        "spec_branch_accepted_tokens",
        "Accepted candidates off each token tree's first chain (what branching added).",
    ),
)


class WorkerStatsCollector(Collector):
    """Turns one ``stats_fn()`` call per scrape into ``pdserve_worker_*`` metrics.

    When ``stats_fn`` raises, the scrape still succeeds with ``pdserve_worker_up 0`` (and
    the error is logged once per failure streak), so Prometheus sees the worker as unhealthy
    instead of the target as down.
    """

    def __init__(self, stats_fn: StatsFn) -> None:
        self.stats_fn = stats_fn
        self._failing = False

    def describe(self) -> Iterable[Metric]:
        return []  # no stats call when registering

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("pdserve_worker_up", "1 if the worker's stats could be read.")
        try:
            stats = self.stats_fn()
        except Exception as err:  # any failure: report it as a metric, never fail the scrape
            if not self._failing:
                log.warning("worker stats unavailable for /metrics: %r", err)
            self._failing = True
            up.add_metric([], 0.0)
            return [up]
        self._failing = False
        up.add_metric([], 1.0)
        return [up, *worker_families(stats)]


def worker_families(stats: worker_pb2.WorkerStats) -> list[Metric]:
    """The gauges and counters of one ``WorkerStats`` (pure)."""
    labels = [stats.worker_id, stats.role]
    families: list[Metric] = []
    for name, doc in _GAUGES:
        gauge = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["worker", "role"])
        gauge.add_metric(labels, float(getattr(stats, name)))
        families.append(gauge)
    usage = GaugeMetricFamily(
        "pdserve_worker_kv_usage", "Fraction of KV blocks in use, 0..1.", labels=["worker", "role"]
    )
    if stats.total_blocks > 0:
        usage.add_metric(labels, (stats.total_blocks - stats.free_blocks) / stats.total_blocks)
    families.append(usage)
    for name, field_name, doc in _COUNTERS:
        counter = CounterMetricFamily(f"pdserve_worker_{name}", doc, labels=["worker", "role"])
        counter.add_metric(labels, float(getattr(stats, field_name)))
        families.append(counter)
    transfers = CounterMetricFamily(
        "pdserve_worker_kv_transfers",
        "KV transfers by result.",
        labels=["worker", "role", "result"],
    )
    transfers.add_metric([*labels, "ok"], float(stats.transfers_ok))
    transfers.add_metric([*labels, "failed"], float(stats.transfers_failed))
    families.append(transfers)
    families.append(_acceptance_length_histogram(stats, labels))
    families.extend(_tier_families(stats, labels))
    families.extend(_peer_fetch_families(stats, labels))
    families.append(
        GaugeMetricFamily(
            "pdserve_worker_epoch", "The worker's incarnation epoch.", value=float(stats.epoch)
        )
    )
    return families


def _tier_families(stats: worker_pb2.WorkerStats, labels: list[str]) -> list[Metric]:
    """The KV tiers' counters, one sample per tier (``host``, ``disk``); zeros when off.
    Tier hits are also in ``prefix_hit_tokens``: the pool's own hits are the difference."""
    tier_labels = ["worker", "role", "tier"]
    hits = CounterMetricFamily(
        "pdserve_worker_kv_tier_hit_tokens",
        "Prompt tokens whose KV was loaded back from a tier instead of computed.",
        labels=tier_labels,
    )
    stored = CounterMetricFamily(
        "pdserve_worker_kv_tier_stored_blocks",
        "KV blocks stored in a tier (host: evicted from the pool; disk: from host memory).",
        labels=tier_labels,
    )
    moved = CounterMetricFamily(
        "pdserve_worker_kv_tier_bytes",
        "int8 KV bytes into a tier (stored) and out of it (loaded back).",
        labels=[*tier_labels, "direction"],
    )
    used = GaugeMetricFamily(
        "pdserve_worker_kv_tier_used_bytes", "Bytes a tier holds now.", labels=tier_labels
    )
    for tier, counts in (("host", stats.host_tier), ("disk", stats.disk_tier)):
        hits.add_metric([*labels, tier], float(counts.hit_tokens))
        stored.add_metric([*labels, tier], float(counts.stored_blocks))
        moved.add_metric([*labels, tier, "in"], float(counts.bytes_in))
        moved.add_metric([*labels, tier, "out"], float(counts.bytes_out))
        used.add_metric([*labels, tier], float(counts.used_bytes))
    stopped = GaugeMetricFamily(
        "pdserve_worker_kv_disk_tier_stopped",
        "1 once a disk tier write failed (e.g. a full disk): no more disk writes.",
        labels=["worker", "role"],
    )
    stopped.add_metric(labels, float(stats.disk_tier_stopped))
    return [hits, stored, moved, used, stopped]


def _peer_fetch_families(stats: worker_pb2.WorkerStats, labels: list[str]) -> list[Metric]:
    """Peer fetch on a prefill worker: prefixes pulled from another prefill worker against
    prefixes computed after a failed fetch, and what moved each way (zeros elsewhere)."""
    prefixes = CounterMetricFamily(
        "pdserve_worker_kv_peer_prefixes",
        "Prompt prefixes the router asked this worker to fetch from a peer, by outcome.",
        labels=["worker", "role", "outcome"],
    )
    prefixes.add_metric([*labels, "fetched"], float(stats.peer_fetches))
    prefixes.add_metric([*labels, "recomputed"], float(stats.recompute_fallbacks))
    blocks = CounterMetricFamily(
        "pdserve_worker_kv_peer_blocks",
        "KV blocks moved by peer fetches: fetched into this worker, served to peers.",
        labels=["worker", "role", "direction"],
    )
    blocks.add_metric([*labels, "fetched"], float(stats.peer_fetched_blocks))
    blocks.add_metric([*labels, "served"], float(stats.peer_served_blocks))
    fetched_bytes = CounterMetricFamily(
        "pdserve_worker_kv_peer_fetched_bytes",
        "KV bytes fetched into this worker from peers.",
        labels=["worker", "role"],
    )
    fetched_bytes.add_metric(labels, float(stats.peer_fetched_bytes))
    return [prefixes, blocks, fetched_bytes]


def _acceptance_length_histogram(
    stats: worker_pb2.WorkerStats, labels: list[str]
) -> HistogramMetricFamily:
    """Accepted candidates per verify chunk, one bucket per length 0..num_speculative_tokens
    (the worker's counts hold one entry per length; none when it does not speculate)."""
    histogram = HistogramMetricFamily(
        "pdserve_worker_spec_acceptance_length",
        "Speculated candidates accepted per verify chunk.",
        labels=["worker", "role"],
    )
    counts = stats.spec_acceptance_length_counts
    if counts:
        cumulative = list(itertools.accumulate(counts))
        buckets = [(str(float(length)), float(n)) for length, n in enumerate(cumulative)]
        buckets.append(("+Inf", float(cumulative[-1])))
        accepted = sum(length * n for length, n in enumerate(counts))
        histogram.add_metric(labels, buckets, float(accepted))
    return histogram


def stats_fn_on_loop(
    async_fn: Callable[[], Awaitable[worker_pb2.WorkerStats]],
    loop: asyncio.AbstractEventLoop,
    timeout_s: float = 2.0,
) -> StatsFn:
    """A blocking ``stats_fn`` that runs ``async_fn()`` on ``loop`` (from the scrape thread)."""

    def call() -> worker_pb2.WorkerStats:
        async def run() -> worker_pb2.WorkerStats:
            return await async_fn()

        future = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()  # do not leave a stats call running on a stuck loop
            raise TimeoutError(f"worker stats took longer than {timeout_s} s") from None

    return call


@dataclass(slots=True)
class MetricsServer:
    """The running endpoint; ``stop()`` closes its socket and joins its thread."""

    host: str
    port: int
    registry: CollectorRegistry
    _server: WSGIServer
    _thread: Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(port: int, stats_fn: StatsFn, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` (0 = a free port) in a daemon thread.

    The registry holds only this worker's collector (not prometheus_client's global one),
    so several workers can run in one process, as the tests do.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector(stats_fn))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, int(server.server_address[1]), registry, server, thread)
