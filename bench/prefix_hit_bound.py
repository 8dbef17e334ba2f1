"""How much better than round-robin can any prefix-aware router hit the prefix cache?

    python -m pdserve.bench.prefix_hit_bound [--groups 8] [--workers 2,3,4] [--capacity 1,2,3,4]
                                     [--per-group 2,4,20] [--seeds 400]

A simulation, not a run: prompts of ``--groups`` groups, each group's prompts sharing one
prefix, arrive in a seeded random order (``--per-group`` prompts per group); each worker
holds ``--capacity`` prefixes under LRU. Two routings:

- round-robin: prompt i to worker i mod W, whatever its prefix;
- partitioned: group g always to worker g mod W. No prefix-aware router can beat it here:
  each prefix lives on one worker only, so the W workers together hold the most distinct
  prefixes they can (W x capacity), and LRU is optimal for prompts that arrive in random
  order.

It prints the share of prompts that find their prefix cached, each routing's, and their
ratio. The steady state is plain arithmetic: round-robin caches the same prefixes on every
worker and hits capacity / groups of the time; partitioning hits min(1, W x capacity /
groups). The ratio is at most W, the number of workers: 2x for the shared-prefix benchmark's
2 prefill workers (docs/benchmarks.md). A few prompts per group adds the first misses, which
round-robin pays once per worker and group, and lifts the ratio a little above W.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Route = Callable[[int, int, int], int]  # (arrival index, group, workers) -> worker


def round_robin(index: int, group: int, workers: int) -> int:
    return index % workers


def partitioned(index: int, group: int, workers: int) -> int:
    return group % workers


@dataclass(frozen=True)
class Scenario:
    groups: int
    workers: int
    capacity: int  # prefixes one worker's cache holds
    per_group: int  # prompts per group


def arrivals(scenario: Scenario, seed: int) -> list[int]:
    """Each prompt's group, in a seeded random arrival order."""
    order = [g for g in range(scenario.groups) for _ in range(scenario.per_group)]
    random.Random(seed).shuffle(order)
    return order


def hit_rate(scenario: Scenario, route: Route, order: Sequence[int]) -> float:
    """Share of prompts in ``order`` whose prefix their worker's LRU cache holds."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(scenario.workers)]
    hits = 0
    for index, group in enumerate(order):
        cache = caches[route(index, group, scenario.workers)]
        if group in cache:
            hits += 1
            cache.move_to_end(group)
            continue
        cache[group] = None
        if len(cache) > scenario.capacity:
            cache.popitem(last=False)
    return hits / len(order)


def mean_hit_rates(scenario: Scenario, seeds: int) -> tuple[float, float]:
    """(round-robin, partitioned) hit rates, each averaged over ``seeds`` arrival orders."""
    orders = [arrivals(scenario, seed) for seed in range(seeds)]
    return (
        statistics.fmean(hit_rate(scenario, round_robin, o) for o in orders),
        statistics.fmean(hit_rate(scenario, partitioned, o) for o in orders),
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    print(f"{args.groups} groups, {args.seeds} seeded arrival orders per row")
    print(f"{'workers':>7s} {'capacity':>8s} {'per group':>9s} {'round-robin':>11s} "
          f"{'partitioned':>11s} {'ratio':>6s}")  # fmt: skip
    for workers in args.workers:
        for capacity in args.capacity:
            for per_group in args.per_group:
                scenario = Scenario(args.groups, workers, capacity, per_group)
                rr, best = mean_hit_rates(scenario, args.seeds)
                ratio = f"{best / rr:5.2f}x" if rr > 0 else "inf"
                rates = f"{rr:11.1%} {best:11.1%} {ratio:>6s}"
                print(f"{workers:7d} {capacity:8d} {per_group:9d} {rates}")


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Simulated prefix-cache hit rates: round-robin vs the best prefix-aware "
        "routing, by number of workers and cache size."
    )
    p.add_argument("--groups", type=int, default=8, help="prefix groups (default 8)")
    p.add_argument("--workers", type=_int_list, default=[2, 3, 4], help="e.g. 2,3,4")
    p.add_argument(
        "--capacity", type=_int_list, default=[1, 2, 3, 4], help="prefixes per worker cache"
    )
    p.add_argument("--per-group", type=_int_list, default=[2, 4, 20], help="prompts per group")
    p.add_argument("--seeds", type=int, default=400, help="arrival orders averaged per row")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
