"""Capacity profile: interpolation over measured decode points, the SLO batch, storage."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint, max_batch_within_itl

POINTS = (
    DecodePoint(1, 100.0, 0.010),
    DecodePoint(8, 640.0, 0.0125),
    DecodePoint(16, 1000.0, 0.016),
    DecodePoint(32, 1280.0, 0.025),
)


def profile(max_batch: int = 16) -> CapacityProfile:
    return CapacityProfile(10_000.0, POINTS, max_batch, startup_s=18.5)


def test_decode_capacity_is_taken_at_the_slo_batch() -> None:
    assert profile().decode_tokens_per_s == 1000.0
    assert profile(max_batch=12).decode_tokens_per_s == pytest.approx(820.0)  # between 8 and 16


def test_interpolation_is_linear_inside_and_flat_outside_the_measurements() -> None:
    p = profile()
    assert p.itl_s_at(12) == pytest.approx(0.01425)
    assert p.decode_tokens_per_s_at(0.5) == 100.0
    assert p.decode_tokens_per_s_at(64) == 1280.0  # no scaling past what was measured
    assert p.prefill_s(2500) == 0.25


def test_max_batch_within_itl_uses_measured_points_only() -> None:
    assert max_batch_within_itl(POINTS, itl_slo_s=0.016) == 16
    assert max_batch_within_itl(POINTS, itl_slo_s=0.020) == 16
    assert max_batch_within_itl(POINTS, itl_slo_s=1.0) == 32
    with pytest.raises(ValueError, match="no measured decode batch"):
        max_batch_within_itl(POINTS, itl_slo_s=0.005)


def test_profile_round_trips_through_json() -> None:
    p = profile()
    assert CapacityProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_bad_profiles_are_rejected() -> None:
    with pytest.raises(ValueError, match="increasing batch sizes"):
        CapacityProfile(1.0, (POINTS[1], POINTS[0]), 1, 0.0)
    with pytest.raises(ValueError, match="increasing batch sizes"):
        CapacityProfile(1.0, (), 1, 0.0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CapacityProfile(0.0, POINTS, 16, 0.0)
    with pytest.raises(ValueError, match="startup_s"):
        CapacityProfile(1.0, POINTS, 16, -1.0)
    with pytest.raises(ValueError, match="itl_s > 0"):
        DecodePoint(4, 10.0, 0.0)
