"""The router's /metrics and /dashboard/data after real requests through a real router in
front of STUB workers (tests/integration/stub_worker.py), parsed with prometheus_client's
own text parser."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.serve.server_metrics import METRIC_NAMES, parse_exposition
from pdserve.proto import worker_pb2
from pdserve.router.request.metered_lifecycle import MeteredLifecycle
from tests.integration.stub_worker import StubCluster, StubWorker, start_stub_cluster

MODEL = "fake-model"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scripted_get_stats(
    self: StubWorker, request: worker_pb2.StatsRequest, context: Any
) -> worker_pb2.WorkerStats:
    """The stub's GetStats, unless a test set ``scripted_stats`` on the servicer."""
    scripted = getattr(self, "scripted_stats", None)
    if scripted is not None:
        return scripted
    return worker_pb2.WorkerStats(worker_id=self.worker_id, role=self.role, free_blocks=1000)


@pytest.fixture(scope="module")
def cluster() -> Iterator[StubCluster]:
    # gRPC binds the servicer's methods when the server starts: patch the class only then.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StubWorker, "GetStats", _scripted_get_stats)
        cluster = start_stub_cluster({"p0": "prefill", "d0": "decode"})
    yield cluster
    cluster.stop()


def scrape(cluster: StubCluster) -> Samples:
    response = httpx.get(f"{cluster.http_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def rise(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def complete(cluster: StubCluster, max_tokens: int, prompt: str = "hello router") -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=10.0)


def test_counts_and_sums_match_what_the_client_saw(cluster: StubCluster) -> None:
    before = scrape(cluster)
    max_tokens = [1, 3, 5, 8, 2]
    usages, client_e2e_s = [], 0.0
    for i, n in enumerate(max_tokens):
        start = time.monotonic()
        response = complete(cluster, n, prompt="x" * (i + 3))
        client_e2e_s += time.monotonic() - start
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    after = scrape(cluster)
    requests = len(max_tokens)
    assert rise(before, after, "pdserve_requests_total", outcome="ok") == requests
    assert rise(before, after, "pdserve_prompt_tokens_total") == sum(
        u["prompt_tokens"] for u in usages
    )
    assert rise(before, after, "pdserve_generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages
    )
    assert rise(before, after, "pdserve_ttft_seconds_count") == requests
    assert rise(before, after, "pdserve_e2e_seconds_count") == requests
    assert rise(before, after, "pdserve_tpot_seconds_count") == sum(n > 1 for n in max_tokens)
    # The stub streams one token per chunk: one gap per token after the first.
    assert rise(before, after, "pdserve_inter_token_latency_seconds_count") == sum(
        n - 1 for n in max_tokens
    )
    e2e_sum_s = rise(before, after, "pdserve_e2e_seconds_sum")
    ttft_sum_s = rise(before, after, "pdserve_ttft_seconds_sum")
    assert 0 < ttft_sum_s <= e2e_sum_s <= client_e2e_s
    # The stub reports 2 ms per transfer; a request done at its first token has no report.
    transfer_s = rise(before, after, "pdserve_kv_transfer_seconds_total")
    assert 0 <= transfer_s <= 0.002 * sum(n > 1 for n in max_tokens) + 1e-9


def test_histogram_buckets_are_cumulative_and_end_at_the_count(cluster: StubCluster) -> None:
    assert complete(cluster, 4).status_code == 200
    after = scrape(cluster)
    for name in ("pdserve_ttft_seconds", "pdserve_e2e_seconds", "pdserve_tpot_seconds"):
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in after.items()
            if sample == f"{name}_bucket"
        )
        counts = [value for _, value in buckets]
        assert counts == sorted(counts), f"{name} buckets must not decrease"
        assert buckets[-1] == (float("inf"), after[(f"{name}_count", ())])
        assert buckets[0][0] == 0.001 and (300.0, counts[-2]) in buckets


def test_the_load_generator_finds_its_counters(cluster: StubCluster) -> None:
    text = httpx.get(f"{cluster.http_url}/metrics").text
    assert set(parse_exposition(text)) == set(METRIC_NAMES)


def test_outcomes_of_refused_failed_and_cancelled_requests(cluster: StubCluster) -> None:
    p0, d0 = cluster.workers["p0"], cluster.workers["d0"]
    before = scrape(cluster)
    d0.knobs.refuse_reserve = True
    assert complete(cluster, 3).status_code == 429
    d0.knobs.refuse_reserve = False
    p0.knobs.fail_before_first_token = 1  # the only prefill worker: nowhere to retry
    assert complete(cluster, 3).status_code == 503
    assert p0.knobs.fail_before_first_token == 0
    d0.knobs.hang_after_first_token = True
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as held:
        assert next(held.iter_lines()).startswith("data: ")
    wait_for(
        lambda: rise(before, scrape(cluster), "pdserve_requests_total", outcome="cancelled") == 1,
        "the router to see the client go",
    )
    d0.knobs.hang_after_first_token = False
    after = scrape(cluster)
    outcomes = {
        o: rise(before, after, "pdserve_requests_total", outcome=o)
        for o in ("ok", "error", "cancelled", "rejected")
    }
    assert outcomes == {"ok": 0, "error": 1, "cancelled": 1, "rejected": 1}
    assert rise(before, after, "pdserve_prompt_tokens_total") == 4  # only "abc" got a token
    # The first token always counts; the decode stub's own first chunk may or may not reach
    # the router before the client's disconnect cancels the stream (a race by design).
    assert rise(before, after, "pdserve_generation_tokens_total") in (1, 2)
    # The refusal and the failure missed their SLO; the cancellation is not counted.
    assert after[("pdserve_slo_attainment", (("window", "60s"),))] < 1.0


def test_worker_counters_accumulate_across_worker_restarts(cluster: StubCluster) -> None:
    assert isinstance(cluster.lifecycle, MeteredLifecycle)
    poller = cluster.lifecycle.observability.poller
    poller.min_interval_s = 0.0  # every scrape asks the workers
    p0, d0 = cluster.workers["p0"], cluster.workers["d0"]

    def p0_stats(epoch: int, prefix_hit_tokens: int) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(
            worker_id="p0", role="prefill", epoch=epoch, prefix_hit_tokens=prefix_hit_tokens,
            transfer_bytes=4096, transfers_failed=1, total_blocks=100, free_blocks=75,
            waiting=2, running=1,
        )  # fmt: skip

    try:
        p0.scripted_stats = p0_stats(1, 40)
        d0.scripted_stats = worker_pb2.WorkerStats(
            epoch=1, transfer_bytes=4096, total_blocks=200, free_blocks=50
        )
        got = scrape(cluster)
        assert got[("pdserve_prefix_hit_tokens_total", (("worker", "p0"),))] == 40
        assert got[("pdserve_kv_transfer_bytes_total", (("worker", "p0"),))] == 4096
        assert ("pdserve_kv_transfer_bytes_total", (("worker", "d0"),)) not in got
        assert got[("pdserve_kv_transfer_failures_total", (("worker", "p0"),))] == 1
        assert got[("pdserve_worker_kv_usage", (("role", "prefill"), ("worker", "p0")))] == 0.25
        assert got[("pdserve_worker_kv_usage", (("role", "decode"), ("worker", "d0")))] == 0.75
        assert got[("pdserve_worker_waiting", (("role", "prefill"), ("worker", "p0")))] == 2
        p0.scripted_stats = p0_stats(1, 50)
        assert scrape(cluster)[("pdserve_prefix_hit_tokens_total", (("worker", "p0"),))] == 50
        p0.scripted_stats = p0_stats(2, 5)  # restarted: a new epoch counting from zero
        assert scrape(cluster)[("pdserve_prefix_hit_tokens_total", (("worker", "p0"),))] == 55
    finally:
        p0.scripted_stats = d0.scripted_stats = None
        poller.min_interval_s = 0.25


def test_dashboard_data_agrees_with_the_metrics(cluster: StubCluster) -> None:
    for n in (2, 6):
        assert complete(cluster, n).status_code == 200
    data = httpx.get(f"{cluster.http_url}/dashboard/data").json()
    metrics = scrape(cluster)
    ok = metrics[("pdserve_requests_total", (("outcome", "ok"),))]
    assert data["counters"]["requests"]["ok"] == ok
    assert data["counters"]["prompt_tokens"] == metrics[("pdserve_prompt_tokens_total", ())]
    assert data["pools"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert [(w["worker_id"], w["role"], w["up"]) for w in data["workers"]] == [
        ("p0", "prefill", True),
        ("d0", "decode", True),
    ]
    ttft, itl = data["latency_ms"]["ttft"], data["latency_ms"]["itl"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert 0 <= itl["p50"] <= itl["p90"] <= itl["p99"]
    windows = {g["window"]: g for g in data["goodput"]}
    assert set(windows) == {"10s", "60s"}
    assert windows["60s"]["good_requests"] <= windows["60s"]["requests"]
    assert data["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def test_dashboard_page_and_assets_are_served_and_nothing_else(cluster: StubCluster) -> None:
    page = httpx.get(f"{cluster.http_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="chart-ttft"' in page.text
    script = httpx.get(f"{cluster.http_url}/dashboard/static/charts.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "class LineChart" in script.text
    for name in ("nope.js", "..%2Fdashboard.py", "__init__.py"):
        assert httpx.get(f"{cluster.http_url}/dashboard/static/{name}").status_code == 404
    schema = httpx.get(f"{cluster.http_url}/openapi.json").json()
    assert not any(path.startswith(("/metrics", "/dashboard")) for path in schema["paths"])
