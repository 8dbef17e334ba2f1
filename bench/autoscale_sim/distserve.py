"""DistServe's comparison: goodput per worker, disaggregated (best prefill:decode split of N
workers) against N colocated workers, on fixed-length mixes under Poisson arrivals.

Goodput is the highest request rate at which >= 90% of requests meet both SLOs (as the
cluster's goodput sweep defines it), found by bisection. Splits: every one for N <= 8, else
a ternary search over the number of prefill workers (goodput is taken as unimodal in it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.autoscale_sim.engine import Simulation
from pdserve.bench.autoscale_sim.model import CostModel, Slo
from pdserve.bench.autoscale_sim.traces import Mix, Trace

ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class Case:
    mix: Mix
    slo: Slo


CASES = (
    Case(Mix("short chat", 512, 64, 512, 64, sigma=0.0), Slo(1.5, 0.150)),
    Case(Mix("long prompts", 2048, 64, 2048, 64, sigma=0.0), Slo(3.0, 0.150)),
    Case(Mix("long outputs", 128, 512, 128, 512, sigma=0.0), Slo(1.5, 0.150)),
)


@dataclass(frozen=True, slots=True)
class Comparison:
    mix: str
    slo: Slo
    workers: int
    best_prefill: int  # of the best split; decode = workers - best_prefill
    disaggregated_rps: float
    colocated_rps: float

    @property
    def ratio(self) -> float:
        """Disaggregated ÷ colocated goodput (inf when colocated serves nothing in SLO)."""
        return self.disaggregated_rps / self.colocated_rps if self.colocated_rps else float("inf")


def poisson_trace(mix: Mix, rate: float, requests: int, seed: int) -> Trace:
    rng = random.Random(f"{mix.name}:{seed}")
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    duration = t + 1e-6
    return Trace(
        mix.name,
        duration,
        rate,
        arrivals,
        [mix.input_mean] * requests,
        [mix.output_mean] * requests,
        lambda _: rate,
        mix,
        mix,
    )


def attainment(
    cost: CostModel, case: Case, pools: dict[str, int], rate: float, requests: int, seed: int
) -> float:
    trace = poisson_trace(case.mix, rate, requests, seed)
    return Simulation(trace, cost, case.slo, None, pools, seed).run().attainment


def goodput(
    cost: CostModel,
    case: Case,
    pools: dict[str, int],
    requests: int,
    seed: int,
    steps: int = 8,
) -> float:
    """The highest rate (to hi / 2**steps) with >= 90% of requests within the SLO."""

    def ok(rate: float) -> bool:
        return attainment(cost, case, pools, rate, requests, seed) >= ATTAINMENT

    n = sum(pools.values())
    hi = n * 1.5 / (cost.prefill_s(case.mix.input_mean) + case.mix.output_mean * 0.01)
    while ok(hi):
        hi *= 2
    lo = 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def compare(
    cost: CostModel,
    case: Case,
    workers: int,
    seed: int,
    requests: int | None = None,
    steps: int = 8,
    on_step: Callable[[], None] | None = None,
) -> Comparison:
    """Best split of ``workers`` against as many colocated workers; ``requests`` per
    simulation (default 200 + 100 per worker)."""
    requests = requests or 200 + 100 * workers
    cache: dict[int, float] = {}

    def split(p: int) -> float:
        if p not in cache:
            pools = {"prefill": p, "decode": workers - p}
            cache[p] = goodput(cost, case, pools, requests, seed, steps)
            if on_step is not None:
                on_step()
        return cache[p]

    if workers <= 8:
        for p in range(1, workers):
            split(p)
    else:
        lo, hi = 1, workers - 1
        while hi - lo > 2:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            lo, hi = (a, hi) if split(a) < split(b) else (lo, b)
        for p in range(lo, hi + 1):
            split(p)
    best = max(cache, key=lambda p: (cache[p], -p))
    colocated = goodput(cost, case, {"colocated": workers}, requests, seed, steps)
    return Comparison(case.mix.name, case.slo, workers, best, cache[best], colocated)
