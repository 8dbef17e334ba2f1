"""SLO attainment and goodput arithmetic (router/observe/goodput.py): crafted samples, window
edges."""

from __future__ import annotations

import math

import pytest

from pdserve.router.observe.goodput import (
    RequestSample,
    SlidingGoodput,
    SloConfig,
    attainment_gauge,
    goodput_figures,
    tpot_s,
    window_label,
)

SLO = SloConfig(ttft_ms=100.0, tpot_ms=20.0, windows_s=(10.0, 60.0))


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert tpot_s(e2e_s=1.0, ttft_s=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot_s(e2e_s=0.5, ttft_s=0.5, output_tokens=3) == 0.0
    assert tpot_s(e2e_s=0.5, ttft_s=0.1, output_tokens=1) is None
    assert tpot_s(e2e_s=0.5, ttft_s=0.1, output_tokens=0) is None
    assert tpot_s(e2e_s=0.7, ttft_s=0.1, output_tokens=2.5) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("sample", "good"),
    [
        (RequestSample(1.0, ttft_s=0.1, tpot_s=0.02), True),  # both exactly at the target
        (RequestSample(1.0, ttft_s=0.1001, tpot_s=0.01), False),  # TTFT missed
        (RequestSample(1.0, ttft_s=0.05, tpot_s=0.0201), False),  # TPOT missed
        (RequestSample(1.0, ttft_s=0.05, tpot_s=None), True),  # one token: no TPOT
        (RequestSample(1.0, ttft_s=0.5, tpot_s=None), False),
        (RequestSample(1.0, ttft_s=0.01, tpot_s=0.01, failed=True), False),
    ],
)
def test_a_request_is_good_only_when_it_meets_both_targets(
    sample: RequestSample, good: bool
) -> None:
    assert sample.meets(SLO) is good


def _samples() -> list[RequestSample]:
    return [
        RequestSample(0.0, 0.05, 0.01),  # on the window's open left edge: excluded
        RequestSample(0.5, 0.05, 0.01),  # good
        RequestSample(5.0, 0.50, 0.01),  # TTFT missed
        RequestSample(9.0, 0.05, None),  # good
        RequestSample(10.0, 0.05, 0.02),  # on the closed right edge: included, good
        RequestSample(10.5, 0.05, 0.01),  # after now: excluded
    ]


def test_window_is_half_open_and_rates_divide_by_the_window() -> None:
    figures = goodput_figures(_samples(), SLO, now_s=10.0, window_s=10.0)
    assert (figures.requests, figures.good_requests) == (4, 3)
    assert figures.span_s == 10.0
    assert figures.request_rps == pytest.approx(0.4)
    assert figures.goodput_rps == pytest.approx(0.3)
    assert figures.slo_attainment == pytest.approx(0.75)


def test_token_rates_count_the_requests_of_the_window() -> None:
    samples = [
        RequestSample(0.0, 0.05, 0.01, prompt_tokens=999, output_tokens=999),  # left edge: out
        RequestSample(2.0, 0.05, 0.01, prompt_tokens=300, output_tokens=40),
        RequestSample(6.0, math.inf, failed=True),  # failed: counted as a request, no tokens
        RequestSample(9.0, 0.05, 0.01, prompt_tokens=100, output_tokens=20),
    ]
    figures = goodput_figures(samples, SLO, now_s=10.0, window_s=10.0)
    assert figures.requests == 3
    assert figures.prompt_tokens_per_s == pytest.approx(40.0)  # 400 tokens / 10 s
    assert figures.output_tokens_per_s == pytest.approx(6.0)
    assert (figures.ttft_mean_s, figures.tpot_mean_s) == (0.05, 0.01)  # the failed one: none
    young = goodput_figures(samples, SLO, now_s=10.0, window_s=10.0, since_s=5.0)
    assert young.prompt_tokens_per_s == pytest.approx(80.0)  # 400 tokens / 5 s of span


def test_a_short_window_sees_only_the_latest_samples() -> None:
    figures = goodput_figures(_samples(), SLO, now_s=10.0, window_s=1.0)
    assert (figures.requests, figures.good_requests) == (1, 1)  # (9, 10]: 10.0 only
    assert figures.goodput_rps == pytest.approx(1.0)
    wider = goodput_figures(_samples(), SLO, now_s=10.0, window_s=1.5)
    assert (wider.requests, wider.good_requests) == (2, 2)  # (8.5, 10]: 9.0 and 10.0


def test_rates_divide_by_the_observed_span_while_younger_than_the_window() -> None:
    samples = [RequestSample(8.0, 0.05, 0.01), RequestSample(9.0, 0.5, 0.01)]
    figures = goodput_figures(samples, SLO, now_s=10.0, window_s=60.0, since_s=6.0)
    assert figures.span_s == pytest.approx(4.0)
    assert figures.request_rps == pytest.approx(0.5)
    assert figures.goodput_rps == pytest.approx(0.25)
    older = goodput_figures(samples, SLO, now_s=10.0, window_s=2.0, since_s=6.0)
    assert older.span_s == 2.0  # the window, once the router is older than it


def test_no_requests_means_zero_rates_and_no_attainment() -> None:
    figures = goodput_figures([], SLO, now_s=100.0, window_s=10.0)
    assert (figures.requests, figures.request_rps, figures.goodput_rps) == (0, 0.0, 0.0)
    assert figures.slo_attainment is None
    at_start = goodput_figures([], SLO, now_s=5.0, window_s=10.0, since_s=5.0)
    assert at_start.span_s == 0.0 and at_start.goodput_rps == 0.0


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        goodput_figures([], SLO, now_s=1.0, window_s=0.0)


def test_sliding_goodput_reports_every_window_and_prunes_past_the_longest() -> None:
    tracker = SlidingGoodput(SLO, since_s=0.0)
    for t in range(1, 31):  # one request per second; every third one misses TTFT
        tracker.record(RequestSample(float(t), 0.5 if t % 3 == 0 else 0.05, 0.01))
    tracker.record(RequestSample(30.5, math.inf, failed=True))
    ten, sixty = tracker.figures(now_s=31.0)
    # (21, 31]: requests 22..30 and the failure; 24, 27, 30 and the failure missed.
    assert (ten.window_s, ten.requests, ten.good_requests) == (10.0, 10, 6)
    assert (sixty.requests, sixty.good_requests) == (31, 20)
    assert sixty.span_s == 31.0 and sixty.goodput_rps == pytest.approx(20 / 31)
    assert len(tracker) == 31
    later = tracker.figures(now_s=85.0)  # keeps (25, 85]: samples 26..30 and the failure
    assert len(tracker) == 6
    assert (later[1].requests, later[1].good_requests) == (6, 3)  # 27, 30, failure missed
    assert later[0].requests == 0 and later[0].slo_attainment is None


def test_attainment_gauge_reads_nan_without_requests() -> None:
    figures = [
        goodput_figures([], SLO, now_s=10.0, window_s=10.0),
        goodput_figures([RequestSample(9.0, 0.01)], SLO, now_s=10.0, window_s=60.0),
    ]
    (label_10, value_10), (label_60, value_60) = attainment_gauge(figures)
    assert (label_10, label_60) == ("10s", "60s")
    assert math.isnan(value_10) and value_60 == 1.0


def test_window_labels() -> None:
    assert [window_label(w) for w in (10.0, 60.0, 0.5, 300)] == ["10s", "60s", "0.5s", "300s"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttft_ms": 0.0}, "SLO targets must be > 0"),
        ({"tpot_ms": -1.0}, "SLO targets must be > 0"),
        ({"windows_s": ()}, "windows_s must be non-empty"),
        ({"windows_s": (10.0, 0.0)}, "windows_s must be non-empty"),
        ({"publish_interval_s": 0.0}, "publish_interval_s must be > 0"),
    ],
)
def test_slo_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SloConfig(**kwargs)  # type: ignore[arg-type]


def test_slo_config_keeps_the_redis_url_out_of_repr() -> None:
    config = SloConfig(redis_url="redis://:hunter2@db:6379/0")
    assert "hunter2" not in repr(config)
    assert (config.ttft_s, config.tpot_s) == (1.0, 0.1)
