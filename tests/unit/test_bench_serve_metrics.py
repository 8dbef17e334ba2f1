"""Percentiles, goodput and server-counter arithmetic, checked against numpy and by hand."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pdserve.bench.serve.metrics import (
    SLO,
    distribution,
    meets_slo,
    parse_goodput,
    percentile,
    summarize,
)
from pdserve.bench.serve.outputs import RequestOutput
from pdserve.bench.serve.server_metrics import ServerFigures, figures, parse_exposition


def _out(
    ttft_ms: float, e2e_ms: float, tokens: int, ok: bool = True, prompt: int = 10
) -> RequestOutput:
    return RequestOutput(
        success=ok,
        prompt_tokens=prompt,
        output_tokens=tokens,
        ttft_s=ttft_ms / 1e3,
        itl_s=tuple([(e2e_ms - ttft_ms) / 1e3 / max(tokens - 1, 1)] * max(tokens - 1, 0)),
        e2e_s=e2e_ms / 1e3,
        sent_at_s=0.0,
        error="" if ok else "boom",
    )


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.lognormvariate(0, 1) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_in_ms_matches_numpy() -> None:
    values_s = [0.010, 0.020, 0.030, 0.100, 0.500]
    dist = distribution(values_s)
    ms = np.array(values_s) * 1000
    assert dist.count == 5
    assert dist.mean_ms == pytest.approx(ms.mean())
    assert dist.std_ms == pytest.approx(ms.std())
    assert dist.p50_ms == pytest.approx(np.percentile(ms, 50))
    assert dist.p90_ms == pytest.approx(np.percentile(ms, 90))
    assert dist.p99_ms == pytest.approx(np.percentile(ms, 99))
    assert math.isnan(distribution([]).mean_ms)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert _out(100, 1000, 10).tpot_s == pytest.approx(0.1)
    assert _out(100, 100, 1).tpot_s is None


def test_goodput_counts_requests_meeting_both_slos() -> None:
    outputs = [
        _out(100, 1000, 10),  # ttft 100, tpot 100 -> meets both
        _out(300, 1200, 10),  # ttft misses
        _out(100, 2800, 10),  # tpot 300 misses
        _out(50, 50, 1),  # one token: no TPOT, meets ttft -> good
        _out(10, 100, 10, ok=False),  # failed: never good
    ]
    slo = SLO(ttft_ms=200, tpot_ms=150)
    assert [meets_slo(o, slo) for o in outputs] == [True, False, False, True, False]
    summary = summarize(outputs, duration_s=4.0, slo=slo)
    assert summary.goodput == pytest.approx(2 / 4.0)
    assert summary.slo_attainment == pytest.approx(2 / 5)
    assert summary.completed == 4 and summary.failed == 1


def test_summary_throughputs_and_no_slo() -> None:
    outputs = [_out(100, 1000, 10, prompt=20), _out(200, 600, 5, prompt=30)]
    summary = summarize(outputs, duration_s=2.0, slo=SLO())
    assert summary.goodput is None and summary.slo_attainment is None
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(15 / 2.0)
    assert summary.total_token_throughput == pytest.approx(65 / 2.0)
    assert summary.ttft.p50_ms == pytest.approx(150.0)
    assert summary.itl.count == 9 + 4
    assert summary.tpot.mean_ms == pytest.approx(np.mean([100.0, 100.0]))


def test_e2el_slo() -> None:
    slo = SLO(e2el_ms=500)
    assert meets_slo(_out(100, 400, 4), slo) and not meets_slo(_out(100, 600, 4), slo)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "tpot:50"]) == SLO(ttft_ms=200.0, tpot_ms=50.0)
    assert parse_goodput([]) == SLO() and not SLO().is_set
    for bad in (["ttft"], ["latency:5"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


EXPOSITION = """\
# HELP pdserve_prefix_hit_tokens_total Prompt tokens served from the prefix cache.
# TYPE pdserve_prefix_hit_tokens_total counter
pdserve_prefix_hit_tokens_total{worker="p0"} 30.0
pdserve_prefix_hit_tokens_total{worker="p1"} 10.0
# TYPE pdserve_prompt_tokens_total counter
pdserve_prompt_tokens_total 200
pdserve_prompt_tokens_created 1.7e9
# TYPE pdserve_kv_transfer_bytes_total untyped
pdserve_kv_transfer_bytes_total 4096
# TYPE other_metric gauge
other_metric 5
"""


def test_parse_exposition_sums_label_sets_and_skips_other_metrics() -> None:
    assert parse_exposition(EXPOSITION) == {
        "pdserve_prefix_hit_tokens_total": 40.0,
        "pdserve_prompt_tokens_total": 200.0,
        "pdserve_kv_transfer_bytes_total": 4096.0,
    }


def test_figures_are_counter_rises_and_absent_metrics_are_none() -> None:
    before = {"pdserve_prefix_hit_tokens_total": 40.0, "pdserve_prompt_tokens_total": 200.0}
    after = {
        "pdserve_prefix_hit_tokens_total": 100.0,
        "pdserve_prompt_tokens_total": 440.0,
        "pdserve_kv_transfer_bytes_total": 1e6,  # absent before: no rise to report
    }
    got = figures(before, after)
    assert got == ServerFigures(prefix_hit_tokens=60.0, prompt_tokens=240.0)
    assert got.prefix_hit_rate == pytest.approx(0.25)
    assert got.kv_transfer_bytes_per_s is None
    rate = ServerFigures(kv_transfer_bytes=2e6, kv_transfer_s=0.5).kv_transfer_bytes_per_s
    assert rate == pytest.approx(4e6)
