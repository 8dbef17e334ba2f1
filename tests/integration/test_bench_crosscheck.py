"""`pdserve bench` against a real local cluster, cross-checked with the router's own metrics.

`pdserve up` runs with 1 prefill + 1 decode worker (real model, Ray, redis-server, NIXL); the
benchmark (its in-process API, the code behind `pdserve bench`) sends N_REQUESTS greedy
completions of exactly OUTPUT_TOKENS tokens. The router's ``/metrics`` is read before and
after, and the differences must agree with what the client measured: request and token counts
exactly, latency percentiles to within one histogram bucket (reasoned out at
``test_client_percentiles_fall_in_the_routers_bucket``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.serve import BenchConfig, RandomSpec, RateResult, run_benchmark
from pdserve.bench.serve.tokens import load_tokenizer
from pdserve.router.observe.metrics import LATENCY_BUCKETS_S
from tests.integration.cluster_proc import UpProcess, start_up

pytestmark = pytest.mark.slow

# N_REQUESTS and OUTPUT_TOKENS are chosen so that the client's p50 and p90 (linear
# interpolation between order statistics, numpy's rule) land exactly on an order statistic,
# and on the same one as Prometheus' histogram_quantile rank rule (the first bucket whose
# cumulative count reaches q * count). That needs count ≡ 1 (mod 10): 11 requests give 11
# TTFT / E2E / TPOT samples, and 11 x (12 - 1) = 121 inter-token gaps.
N_REQUESTS = 11
OUTPUT_TOKENS = 12
PROMPT_TOKENS = 32
QUANTILES = (0.5, 0.9)
# client Summary field -> router histogram
HISTOGRAMS = {
    "ttft": "pdserve_ttft_seconds",
    "itl": "pdserve_inter_token_latency_seconds",
    "e2el": "pdserve_e2e_seconds",
    "tpot": "pdserve_tpot_seconds",
}
# The client's interval contains the router's for these (see the percentile test).
CLIENT_SEES_MORE = frozenset({"ttft", "e2el"})

Scrape = dict[str, float]  # sample name{labels} -> value


@dataclass(frozen=True)
class CrossCheck:
    run: RateResult
    before: Scrape
    after: Scrape

    def rise(self, key: str) -> float:
        """How much sample ``key`` grew during the run (KeyError if the router lacks it)."""
        return self.after[key] - self.before[key]

    def bucket_counts(self, histogram: str) -> list[float]:
        """This run's cumulative count per bucket, in LATENCY_BUCKETS_S order, then +Inf."""
        bounds = [*(_le(b) for b in LATENCY_BUCKETS_S), "+Inf"]
        return [self.rise(f'{histogram}_bucket{{le="{le}"}}') for le in bounds]


def _le(bound_s: float) -> str:
    return str(float(bound_s))  # prometheus_client writes bucket bounds with repr(float)


def scrape(http_url: str) -> Scrape:
    text = httpx.get(f"{http_url}/metrics", timeout=10.0).text
    samples: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.fixture(scope="module")
def crosscheck(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrossCheck]:
    up = start_up(tmp_path_factory.mktemp("bench_crosscheck"), "--prefill", "1", "--decode", "1")
    try:
        with ThreadPoolExecutor(1) as pool:  # the tokenizer loads while the cluster starts
            tokenizer = pool.submit(load_tokenizer, "default")
            up.wait_serving()
            config = _config(up, tokenizer.result())
        before = scrape(up.http_url)
        result = run_benchmark(config)
        after = scrape(up.http_url)
        yield CrossCheck(result.runs[0], before, after)
    finally:
        up.stop()


def _config(up: UpProcess, tokenizer: object) -> BenchConfig:
    return BenchConfig(
        dataset=RandomSpec(PROMPT_TOKENS, OUTPUT_TOKENS, range_ratio=0.0),
        num_prompts=N_REQUESTS,
        request_rates=(math.inf,),  # all at once: one continuous batch
        base_url=up.http_url,
        ignore_eos=True,  # exactly OUTPUT_TOKENS each: a count known without the server
        show_progress=False,
        tokenizer=tokenizer,  # type: ignore[arg-type]
    )


def test_request_counts_equal_exactly(crosscheck: CrossCheck) -> None:
    summary = crosscheck.run.summary
    failures = [o.error for o in crosscheck.run.outputs if not o.success]
    assert (summary.completed, summary.failed) == (N_REQUESTS, 0), failures
    assert crosscheck.rise('pdserve_requests_total{outcome="ok"}') == summary.completed
    router_failed = sum(
        crosscheck.rise(f'pdserve_requests_total{{outcome="{outcome}"}}')
        for outcome in ("error", "rejected", "cancelled")
    )
    assert router_failed == summary.failed
    # one histogram sample per completed request (ITL: one per gap between token events)
    for name in ("pdserve_ttft_seconds", "pdserve_e2e_seconds", "pdserve_tpot_seconds"):
        assert crosscheck.rise(f"{name}_count") == summary.completed, name
    # One chunk per engine step, one token each; the client counts every chunk that carries
    # a token (even one whose text is an incomplete UTF-8 character).
    client_gaps = sum(len(o.itl_s) for o in crosscheck.run.outputs)
    assert client_gaps == N_REQUESTS * (OUTPUT_TOKENS - 1)
    assert crosscheck.rise("pdserve_inter_token_latency_seconds_count") == client_gaps


def test_token_counts_equal_exactly(crosscheck: CrossCheck) -> None:
    summary = crosscheck.run.summary
    assert summary.output_tokens == N_REQUESTS * OUTPUT_TOKENS
    assert crosscheck.rise("pdserve_generation_tokens_total") == summary.output_tokens
    assert summary.input_tokens == N_REQUESTS * PROMPT_TOKENS  # usage from the server
    assert crosscheck.rise("pdserve_prompt_tokens_total") == summary.input_tokens


def bucket_of(value_s: float) -> int:
    """Index of the histogram bucket holding ``value_s`` (upper bounds inclusive, as ``le``);
    len(LATENCY_BUCKETS_S) is the +Inf bucket."""
    return bisect.bisect_left(LATENCY_BUCKETS_S, value_s)


def router_quantile_bucket(cumulative: list[float], q: float) -> int:
    """The bucket Prometheus' histogram_quantile(q) interpolates in: the first whose
    cumulative count reaches q * count."""
    rank = q * cumulative[-1]
    return next(i for i, count in enumerate(cumulative) if count >= rank)


@pytest.mark.parametrize("q", QUANTILES)
@pytest.mark.parametrize("metric", sorted(HISTOGRAMS))
def test_client_percentiles_fall_in_the_routers_bucket(
    crosscheck: CrossCheck, metric: str, q: float
) -> None:
    """Why "the same or an adjacent bucket" is the right tolerance:

    * Same samples, same order statistic. The counts match (test above) and, by the choice of
      N_REQUESTS and OUTPUT_TOKENS, the client's percentile IS the k-th smallest sample and
      histogram_quantile interpolates inside the bucket of the k-th smallest sample, for
      the same k. Were both sides to time the same intervals, the buckets would be equal.
    * They time slightly different intervals. The client's clock starts before the POST is
      sent and stops after the SSE event is parsed; the router's starts after FastAPI has
      parsed the body and ticks before the chunk is encoded and written. If every client
      sample is within d of its router counterpart, the k-th smallest are within d of each
      other (sorting preserves such a pairing), so a percentile moves by at most d. For TTFT
      and E2E the client interval contains the router's, so the client's k-th sample is
      never the smaller one: its bucket is never below the router's.
    * d is loopback HTTP + event-loop scheduling: milliseconds. A move of d crosses at most
      one bucket bound wherever the buckets are wider than d: >= 5 ms from 10 ms up,
      >= 100 ms from 0.2 s up, while a decode step of this model on one CPU core takes
      tens of milliseconds and a TTFT hundreds. Two buckets apart would mean the client
      and the router disagree by more than a whole bucket: a real bug (a clock started in
      the wrong place, samples lost or double-counted), which is what this test catches.
    """
    summary_field = getattr(crosscheck.run.summary, metric)
    client_s = {0.5: summary_field.p50_ms, 0.9: summary_field.p90_ms}[q] / 1000.0
    client_bucket = bucket_of(client_s)
    router_bucket = router_quantile_bucket(crosscheck.bucket_counts(HISTOGRAMS[metric]), q)
    explain = (
        f"{metric} p{q * 100:g}: client {client_s * 1000:.1f} ms in bucket {client_bucket}, "
        f"router in bucket {router_bucket} (bounds {_bounds(router_bucket)} s)"
    )
    assert abs(client_bucket - router_bucket) <= 1, explain
    if metric in CLIENT_SEES_MORE:
        assert client_bucket >= router_bucket, explain


def _bounds(bucket: int) -> tuple[float, float]:
    lower = LATENCY_BUCKETS_S[bucket - 1] if bucket > 0 else 0.0
    upper = LATENCY_BUCKETS_S[bucket] if bucket < len(LATENCY_BUCKETS_S) else math.inf
    return lower, upper
