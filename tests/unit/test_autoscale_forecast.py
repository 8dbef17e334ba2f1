"""Load forecasting: Holt's trend follows ramps, short histories fall back to the last value."""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscale import HoltForecaster, LoadForecaster, LoadSample


def test_follows_a_linear_trend() -> None:
    f = HoltForecaster(alpha=0.5, beta=0.1, min_samples=3)
    for t in range(0, 400, 10):  # 10 + 2/s
        f.observe(float(t), 10.0 + 2.0 * t)
    last_t = 390.0
    assert f.predict(0.0) == pytest.approx(10.0 + 2.0 * last_t, rel=5e-3)
    assert f.predict(30.0) == pytest.approx(10.0 + 2.0 * (last_t + 30.0), rel=5e-3)
    # the trend, not only the level: 30 s ahead is about 60 more
    assert f.predict(30.0) - f.predict(0.0) == pytest.approx(60.0, rel=0.05)


def test_falls_back_to_the_last_value_while_history_is_short() -> None:
    f = HoltForecaster(min_samples=3)
    assert f.predict(60.0) == 0.0  # nothing seen yet
    f.observe(0.0, 100.0)
    f.observe(10.0, 200.0)
    assert f.samples == 2 and f.predict(60.0) == 200.0  # no trend from two points
    f.observe(20.0, 300.0)
    assert f.predict(0.0) != 300.0  # smoothing from the third sample on


def test_steady_load_forecasts_itself_and_never_goes_negative() -> None:
    f = HoltForecaster()
    for i in range(5):
        f.observe(10.0 * i, 7.0)
    assert f.predict(100.0) == 7.0
    falling = HoltForecaster(alpha=1.0, beta=1.0)
    for t, v in ((0.0, 30.0), (10.0, 20.0), (20.0, 10.0)):
        falling.observe(t, v)
    assert falling.predict(100.0) == 0.0


def test_irregular_intervals_and_time_order() -> None:
    f = HoltForecaster(alpha=1.0, beta=1.0, min_samples=2)
    f.observe(0.0, 0.0)
    f.observe(4.0, 8.0)  # 2 per second
    assert f.predict(1.0) == 10.0
    f.observe(4.0, 8.0)  # same instant: no slope from it
    assert f.predict(1.0) == 10.0
    with pytest.raises(ValueError, match="time order"):
        f.observe(3.0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        HoltForecaster(alpha=0.0)


def test_load_forecaster_keeps_token_means_through_idle_windows() -> None:
    f = LoadForecaster(min_samples=1)
    f.observe(0.0, LoadSample(4.0, 500.0, 100.0))
    f.observe(10.0, LoadSample(0.0, 0.0, 0.0))  # idle: no mean to learn from
    predicted = f.predict(0.0)
    assert predicted.mean_input_tokens == 500.0 and predicted.mean_output_tokens == 100.0
    assert predicted.request_rate_per_s == pytest.approx(2.0)  # 0.5 × 0 + 0.5 × 4


def test_load_sample_from_goodput_rates() -> None:
    sample = LoadSample.from_rates(4.0, 2000.0, 400.0)
    assert sample == LoadSample(4.0, 500.0, 100.0)
    assert (sample.input_tokens_per_s, sample.output_tokens_per_s) == (2000.0, 400.0)
    assert LoadSample.from_rates(0.0, 0.0, 0.0) == LoadSample(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        LoadSample(-1.0, 0.0, 0.0)
