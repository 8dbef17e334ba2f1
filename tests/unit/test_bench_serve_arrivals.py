"""Arrival schedules: Poisson gaps with the right mean, burstiness, rate parsing."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from pdserve.bench.serve.arrivals import arrival_offsets_s, inter_arrival_s, parse_rates


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_gaps_have_mean_one_over_rate(rate: float) -> None:
    gaps = inter_arrival_s(20_000, rate, seed=11)
    # Standard error of the mean is (1/rate)/sqrt(20000) = 0.7% of it; allow 3%.
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: standard deviation equals the mean (coefficient of variation 1).
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)


def test_poisson_counts_per_unit_time_have_variance_equal_to_mean() -> None:
    offsets = arrival_offsets_s(20_000, 10.0, seed=3)
    counts = [0] * math.ceil(offsets[-1])
    for t in offsets:
        counts[min(int(t), len(counts) - 1)] += 1
    mean = statistics.fmean(counts[:-1])
    assert mean == pytest.approx(10.0, rel=0.05)
    assert statistics.pvariance(counts[:-1]) == pytest.approx(mean, rel=0.15)


def test_burstiness_sets_the_coefficient_of_variation() -> None:
    gaps = inter_arrival_s(20_000, 2.0, seed=5, burstiness=0.25)
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    # Gamma with shape k has CV 1/sqrt(k) = 2.
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.1)


def test_offsets_start_at_zero_and_never_decrease() -> None:
    offsets = arrival_offsets_s(50, 3.0, seed=0)
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    gaps = inter_arrival_s(50, 3.0, seed=0)
    assert offsets[-1] == pytest.approx(sum(gaps[:-1]))


def test_seeded_and_infinite_rate() -> None:
    assert inter_arrival_s(10, 2.0, seed=1) == inter_arrival_s(10, 2.0, seed=1)
    assert inter_arrival_s(10, 2.0, seed=1) != inter_arrival_s(10, 2.0, seed=2)
    assert arrival_offsets_s(5, math.inf, seed=0) == [0.0] * 5


def test_parse_rates() -> None:
    assert parse_rates("4") == (4.0,)
    assert parse_rates("1, 2,4.5") == (1.0, 2.0, 4.5)
    assert parse_rates("inf") == (math.inf,)
    for bad in ("0", "-1", "fast", "1,,2", "nan"):
        with pytest.raises(ValueError, match="request-rate"):
            parse_rates(bad)


def test_bad_burstiness() -> None:
    with pytest.raises(ValueError, match="burstiness"):
        inter_arrival_s(3, 1.0, seed=0, burstiness=0.0)
