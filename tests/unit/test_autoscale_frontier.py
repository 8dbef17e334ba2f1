"""The planner's frontier of attainment against worker-hours, and a baseline judged at its
own worker-hours (bench/autoscale_sim/frontier.py)."""

from __future__ import annotations

import pytest

from pdserve.bench.autoscale_sim.frontier import (
    OperatingPoint,
    Run,
    attainment_at,
    best_within,
    pareto,
)

RUNS = [
    Run("u=0.8", 280.0, 0.92),
    Run("u=0.9", 245.0, 0.93),  # cheaper and better: the 0.8 run is off the frontier
    Run("u=1.0", 217.0, 0.94),
    Run("u=1.0 b=0.7", 180.0, 0.85),
    Run("u=1.0 b=0.5", 130.0, 0.70),
]


def test_pareto_keeps_the_runs_nothing_beats() -> None:
    assert [r.policy for r in pareto(RUNS)] == ["u=1.0 b=0.5", "u=1.0 b=0.7", "u=1.0"]
    assert pareto([]) == []
    tie = [Run("a", 100.0, 0.9), Run("b", 100.0, 0.95)]
    assert pareto(tie) == [Run("b", 100.0, 0.95)]


def test_attainment_at_interpolates_between_frontier_runs() -> None:
    front = pareto(RUNS)
    assert attainment_at(front, 155.0) == pytest.approx(0.70 + 0.5 * 0.15)
    assert attainment_at(front, 180.0) == pytest.approx(0.85)
    assert attainment_at(front, 300.0) == pytest.approx(0.94)  # its dearest run, at fewer
    assert attainment_at(front, 129.9) is None  # cheaper than any planner run
    assert attainment_at([], 100.0) is None


def test_best_within_is_a_run_that_spent_no_more() -> None:
    assert best_within(RUNS, 250.0) == Run("u=1.0", 217.0, 0.94)
    assert best_within(RUNS, 200.0) == Run("u=1.0 b=0.7", 180.0, 0.85)
    assert best_within(RUNS, 130.0) == Run("u=1.0 b=0.5", 130.0, 0.70)
    assert best_within(RUNS, 129.0) is None


def test_operating_points_round_trip_through_their_keys() -> None:
    for point in (OperatingPoint(0.9), OperatingPoint(1.0, 0.5), OperatingPoint(0.8, hold_s=9)):
        assert OperatingPoint.parse(point.key) == point
    assert OperatingPoint(0.9).key == "planner:u=0.9"
    assert OperatingPoint(1.0, 0.5).key == "planner:u=1:b=0.5"
    assert OperatingPoint(1.0, 0.5).name == "pdserve planner at 100%, pools ≤ 0.5× peak"
    assert OperatingPoint(0.8, hold_s=2400).key == "planner:u=0.8:hold=2400"
    assert OperatingPoint.parse("planner") is None and OperatingPoint.parse("fixed") is None
    for bad in ("planner:b=0.5", "planner:u=0.9:x=1"):
        with pytest.raises(ValueError, match="planner:u=U"):
            OperatingPoint.parse(bad)
