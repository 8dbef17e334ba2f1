"""The router's metrics without servers: exposition, the live collector, worker counters,
dashboard percentiles, the goodput hash format, the Grafana dashboard's metric names."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.proto import worker_pb2
from pdserve.router.observe.dashboard import static_file
from pdserve.router.observe.goodput import GoodputFigures, RequestSample, SloConfig, goodput_figures
from pdserve.router.observe.goodput_store import (
    goodput_fields,
    goodput_key,
    parse_goodput,
    routers_key,
)
from pdserve.router.observe.latency_window import LatencyWindow, percentile
from pdserve.router.observe.metrics import RouterMetrics
from pdserve.router.observe.worker_stats import (
    WorkerCounters,
    WorkerSnapshot,
    WorkerTotals,
    counter_increase,
)
from pdserve.router.request.types import RequestTiming
from pdserve.worker.metrics import worker_families

REPO = Path(__file__).resolve().parents[2]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_histograms_and_counters_expose_what_was_observed() -> None:
    metrics = RouterMetrics()
    metrics.observe_timing(RequestTiming(0.004, 0.5, 0.0, 0.25, itl_s=(0.01, 0.2)), 0.03)
    metrics.observe_timing(RequestTiming(2.0, 3.0, 0.0), None)
    metrics.observe_outcome("ok")
    metrics.observe_outcome("rejected")
    got = _samples(metrics.exposition().decode())
    assert got[("pdserve_ttft_seconds_count", ())] == 2
    assert got[("pdserve_ttft_seconds_sum", ())] == pytest.approx(2.004)
    assert got[("pdserve_ttft_seconds_bucket", (("le", "0.0025"),))] == 0
    assert got[("pdserve_ttft_seconds_bucket", (("le", "0.005"),))] == 1
    assert got[("pdserve_ttft_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("pdserve_inter_token_latency_seconds_count", ())] == 2
    assert got[("pdserve_inter_token_latency_seconds_sum", ())] == pytest.approx(0.21)
    assert got[("pdserve_tpot_seconds_count", ())] == 1  # the one-token request has no TPOT
    assert got[("pdserve_e2e_seconds_sum", ())] == pytest.approx(3.5)
    assert got[("pdserve_kv_transfer_seconds_total", ())] == pytest.approx(0.25)
    outcomes = {
        o: got[("pdserve_requests_total", (("outcome", o),))] for o in metrics.totals()["requests"]
    }
    assert outcomes == {"ok": 1, "error": 0, "cancelled": 0, "rejected": 1}
    assert metrics.totals()["requests"] == outcomes


def test_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="outcome must be one of"):
        RouterMetrics().observe_outcome("timeout")


def test_two_routers_in_one_process_keep_separate_registries() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.prompt_tokens.inc(7)
    assert _samples(a.exposition().decode())[("pdserve_prompt_tokens_total", ())] == 7
    assert _samples(b.exposition().decode())[("pdserve_prompt_tokens_total", ())] == 0


def _snapshot(worker_id: str, role: str, **counts: int) -> WorkerSnapshot:
    return WorkerSnapshot(
        worker_id, role, epoch=1, waiting=2, running=3, free_blocks=30, cached_blocks=5,
        total_blocks=40, counters=WorkerCounters(**counts),
    )  # fmt: skip


@dataclass
class FakeLive:
    slo: SloConfig = field(default_factory=SloConfig)
    figures: list[GoodputFigures] = field(default_factory=list)

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": 2, "decode": 1}

    def worker_snapshots(self) -> Sequence[WorkerSnapshot]:
        return [_snapshot("p0", "prefill"), _snapshot("d0", "decode")]

    def worker_up(self) -> dict[str, bool]:
        return {"p0": True, "d0": True, "p1": False}

    def worker_totals(self) -> Sequence[WorkerTotals]:
        return [
            WorkerTotals("p0", "prefill", WorkerCounters(prefix_hit_tokens=32, transfer_bytes=9)),
            WorkerTotals("d0", "decode", WorkerCounters(prefix_hit_tokens=5, transfer_bytes=9)),
            WorkerTotals("c0", "colocated", WorkerCounters(prefix_hit_tokens=16)),
        ]

    def goodput(self) -> Sequence[GoodputFigures]:
        return self.figures

    def link_rates(self) -> dict[tuple[str, str], float]:
        return {("p0", "d0"): 2.5e8}


def test_live_collector_reads_pools_workers_and_goodput_at_scrape_time() -> None:
    slo = SloConfig(ttft_ms=200.0, tpot_ms=50.0, windows_s=(10.0, 60.0))
    live = FakeLive(slo)
    metrics = RouterMetrics(live)
    live.figures = [  # set after construction: read at scrape, not at registration
        goodput_figures([RequestSample(5.0, 0.1, 0.01)], slo, 10.0, 10.0),
        goodput_figures([], slo, 10.0, 60.0),
    ]
    got = _samples(metrics.exposition().decode())
    assert got[("pdserve_pool_workers", (("role", "prefill"),))] == 2
    assert got[("pdserve_pool_workers", (("role", "colocated"),))] == 0
    assert got[("pdserve_worker_kv_usage", (("role", "prefill"), ("worker", "p0")))] == 0.25
    assert got[("pdserve_worker_running", (("role", "decode"), ("worker", "d0")))] == 3
    assert got[("pdserve_worker_up", (("worker", "p1"),))] == 0
    # Prefix hits from the roles that compute prompts, bytes from the sending side only.
    hits = {k[1]: v for k, v in got.items() if k[0] == "pdserve_prefix_hit_tokens_total"}
    assert hits == {(("worker", "p0"),): 32, (("worker", "c0"),): 16}
    sent = {k[1]: v for k, v in got.items() if k[0] == "pdserve_kv_transfer_bytes_total"}
    assert sent == {(("worker", "p0"),): 9}
    assert got[("pdserve_goodput_rps", (("window", "10s"),))] == pytest.approx(0.1)
    assert got[("pdserve_slo_attainment", (("window", "10s"),))] == 1.0
    assert math.isnan(got[("pdserve_slo_attainment", (("window", "60s"),))])
    assert got[("pdserve_slo_ttft_seconds", ())] == pytest.approx(0.2)
    link = ("pdserve_router_link_bytes_per_second", (("decode", "d0"), ("prefill", "p0")))
    assert got[link] == 2.5e8


def test_counter_increase_handles_first_sight_growth_and_restarts() -> None:
    first = _snapshot("p0", "prefill", prefix_hit_tokens=10, transfer_bytes=100)
    assert counter_increase(None, first) == first.counters
    grown = _snapshot("p0", "prefill", prefix_hit_tokens=15, transfer_bytes=160)
    assert counter_increase(first, grown) == WorkerCounters(prefix_hit_tokens=5, transfer_bytes=60)
    went_down = _snapshot("p0", "prefill", prefix_hit_tokens=3, transfer_bytes=500)
    assert counter_increase(grown, went_down) == went_down.counters  # restarted, same epoch
    new_epoch = replace(grown, epoch=2)
    assert counter_increase(grown, new_epoch) == grown.counters


def test_worker_counters_arithmetic() -> None:
    a = WorkerCounters(1, 2, 3, 4, 5, 6, 7)
    assert a.plus(a) == WorkerCounters(2, 4, 6, 8, 10, 12, 14)
    assert a.plus(a).minus(a) == a
    assert a.minus(a.plus(a)) is None


def test_percentile_matches_numpy() -> None:
    values = sorted([0.3, 0.01, 5.0, 0.2, 0.2, 1.7, 0.05])
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q * 100)))
    assert percentile([4.0], 0.99) == 4.0
    with pytest.raises(ValueError, match="quantile must be in"):
        percentile(values, 1.5)


def test_latency_window_drops_samples_older_than_its_horizon() -> None:
    window = LatencyWindow(horizon_s=10.0)
    assert window.quantiles(0.0) is None
    window.add(1.0, 9.0)
    window.add_many(5.0, [1.0, 2.0, 3.0])
    assert window.quantiles(10.0, (0.5,)) == {0.5: 2.5}
    assert window.quantiles(11.0, (0.0, 1.0)) == {0.0: 1.0, 1.0: 3.0}  # 1.0 left
    assert window.quantiles(16.0) is None


def test_goodput_hash_round_trips_and_omits_missing_attainment() -> None:
    slo = SloConfig(ttft_ms=250.0, tpot_ms=40.0)
    figures = [
        goodput_figures([RequestSample(9.0, 0.1, 0.01), RequestSample(9.5, 1.0)], slo, 10.0, 10.0),
        goodput_figures([], slo, 10.0, 60.0, since_s=0.0),
    ]
    fields = goodput_fields("r1", slo, figures, now_unix_s=1700000000.25)
    assert "slo_attainment:60s" not in fields
    stored = parse_goodput(fields)
    assert (stored.router_id, stored.updated_unix_ms) == ("r1", 1700000000250)
    assert (stored.slo_ttft_ms, stored.slo_tpot_ms) == (250.0, 40.0)
    ten, sixty = stored.windows
    assert (ten.window, ten.requests, ten.good_requests, ten.slo_attainment) == ("10s", 2, 1, 0.5)
    assert ten.goodput_rps == pytest.approx(0.1)
    assert (sixty.window, sixty.requests, sixty.slo_attainment) == ("60s", 0, None)
    assert goodput_key("pdserve:", "r1") == "pdserve:slo:router:r1"
    assert routers_key("t1:") == "t1:slo:routers"
    with pytest.raises(ValueError, match="worker_id must be"):
        goodput_key("pdserve:", "bad id")


def _exposed_names() -> set[str]:
    """Every sample name the router and the worker exporter can expose."""
    live = FakeLive()
    live.figures = [goodput_figures([], live.slo, 1.0, 10.0)]
    text = RouterMetrics(live).exposition().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    stats = worker_pb2.WorkerStats(worker_id="w", role="prefill", total_blocks=4)
    for family in worker_families(stats):
        names |= {s.name for s in family.samples}
    return names


def test_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((REPO / "deploy/grafana/pdserve-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 10
    used = {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z_]+\b", expr)}
    missing = used - _exposed_names()
    assert not missing, f"the Grafana dashboard queries metrics nobody exposes: {missing}"
    for name in ("pdserve_goodput_rps", "pdserve_ttft_seconds_bucket", "pdserve_worker_kv_usage"):
        assert name in used


def test_dashboard_assets_are_local_and_wired_together() -> None:
    html = static_file("dashboard.html").decode()
    js = static_file("dashboard.js").decode()
    assets = ("charts.js", "dashboard.js", "dashboard.css")
    for asset in assets:
        assert f"/dashboard/static/{asset}" in html
    for text in (html, *(static_file(a).decode() for a in assets)):
        assert not re.search(r"(src|href)=\"https?://", text), "no CDN: assets must be local"
    canvases = re.findall(r'<canvas id="(chart-[a-z]+)"', html)
    assert len(canvases) == 11
    for canvas_id in canvases:  # every canvas has a chart object in the script
        assert f'"{canvas_id}"' in js
