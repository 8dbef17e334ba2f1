"""The prefix-hit simulation: exact hit counts on hand-made orders, LRU eviction, and the
bound it exists to show (the ratio to round-robin is about the number of workers)."""

from __future__ import annotations

import pytest

from pdserve.bench.prefix_hit_bound import (
    Scenario,
    arrivals,
    hit_rate,
    main,
    mean_hit_rates,
    partitioned,
    round_robin,
)


def test_round_robin_pays_each_prefix_once_per_worker() -> None:
    two_workers = Scenario(groups=2, workers=2, capacity=1, per_group=2)
    # Round-robin sends each group's two prompts to different workers: four misses, and the
    # third prompt evicts the first worker's only prefix. Partitioned misses once per group.
    assert hit_rate(two_workers, round_robin, [0, 0, 1, 1]) == 0.0
    assert hit_rate(two_workers, partitioned, [0, 0, 1, 1]) == 0.5
    # Alternating groups land on their own worker either way.
    assert hit_rate(two_workers, round_robin, [0, 1, 0, 1]) == 0.5


def test_cache_evicts_least_recently_used_prefix() -> None:
    one_worker = Scenario(groups=3, workers=1, capacity=2, per_group=2)
    # [0, 1] -> 0 hits, now [1, 0] -> 2 evicts 1 -> 1 misses -> 0 (evicted by 1) misses.
    assert hit_rate(one_worker, round_robin, [0, 1, 0, 2, 1, 0]) == pytest.approx(1 / 6)


def test_arrivals_are_seeded_and_complete() -> None:
    scenario = Scenario(groups=4, workers=2, capacity=1, per_group=3)
    order = arrivals(scenario, seed=7)
    assert order == arrivals(scenario, seed=7) != arrivals(scenario, seed=8)
    assert sorted(order) == [g for g in range(4) for _ in range(3)]


def test_ratio_to_round_robin_is_about_the_number_of_workers() -> None:
    for workers, capacity in ((2, 2), (2, 4), (4, 2)):
        rr, best = mean_hit_rates(Scenario(8, workers, capacity, per_group=20), seeds=100)
        # Steady state: round-robin hits capacity / groups, partitioned W * capacity / groups
        # (at most 1 minus the first misses); the first misses lift the ratio a little.
        assert rr == pytest.approx(capacity / 8, abs=0.05)
        assert best == pytest.approx(min(workers * capacity / 8, 0.95), abs=0.05)
        assert workers * 0.95 <= best / rr <= workers * 1.15


def test_cli_prints_a_row_per_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--workers", "2", "--capacity", "1,4", "--per-group", "20", "--seeds", "20"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[:3] for r in rows] == [["2", "1", "20"], ["2", "4", "20"]]
    with pytest.raises(SystemExit):
        main(["--workers", "0"])
