"""Request traces: seeded, deterministic arrival times and prompt/output lengths.

Arrivals are a non-homogeneous Poisson process (thinning of a rate-``peak`` process) under a
rate curve per trace; lengths are clipped log-normal draws of a :class:`Mix`:

* ``steady``: the peak rate throughout;
* ``bursty``: on/off bursts (a two-state Markov-modulated Poisson process): 30% of the peak
  off, the peak on, exponential on (mean 6 min) and off (mean 12 min) periods;
* ``diurnal``: one day compressed into the trace, a sinusoid from 15% of the peak (start
  and end) to the peak (middle);
* ``shift``: a constant rate whose prompts shift from ``chat`` to ``long prompts`` between a
  third and two thirds of the trace.

The peak rate is sized so that the peak needs ``peak_workers`` workers (prefill + decode,
each at ``UTILIZATION``; :func:`pool_sizes`). Each trace starts with ``WARMUP_S`` at its
starting rate, so that no policy sees an empty cluster fill up; that part is not counted.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.autoscale_sim.model import CostModel, Slo

TRACES = ("steady", "bursty", "diurnal", "shift")
UTILIZATION = 0.8  # the planner's default target_utilization, used for every sizing
WARMUP_S = 300.0  # served before the trace's time 0 at its starting rate, not counted


@dataclass(frozen=True, slots=True)
class Mix:
    """Prompt and output lengths: log-normal with these means, clipped to [min, max]."""

    name: str
    input_mean: int
    output_mean: int
    input_max: int
    output_max: int
    sigma: float = 0.5
    input_min: int = 32
    output_min: int = 2

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return (
            _draw(rng, self.input_mean, self.sigma, self.input_min, self.input_max),
            _draw(rng, self.output_mean, self.sigma, self.output_min, self.output_max),
        )


CHAT = Mix("chat", 512, 256, 1024, 1024)
LONG_PROMPTS = Mix("long prompts", 1024, 256, 1400, 1024, sigma=0.3)


def _draw(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    if sigma <= 0:
        return int(mean)
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


@dataclass(frozen=True, slots=True)
class MixStats:
    """Means over a fixed seeded sample of a mix: what sizing and profiles use."""

    input_mean: float
    output_mean: float
    prefill_s_mean: float

    @classmethod
    @functools.cache
    def of(cls, mix: Mix, cost: CostModel, samples: int = 20_000) -> MixStats:
        rng = random.Random(12345)
        draws = [mix.sample(rng) for _ in range(samples)]
        return cls(
            sum(i for i, _ in draws) / samples,
            sum(o for _, o in draws) / samples,
            sum(cost.prefill_s(i) for i, _ in draws) / samples,
        )


def pool_sizes(cost: CostModel, stats: MixStats, slo: Slo, rate: float) -> tuple[int, int]:
    """(prefill, decode) workers that serve ``rate`` req/s of a mix at ``UTILIZATION``."""
    prefill = rate * stats.prefill_s_mean / UTILIZATION
    per_decode = cost.decode_rate_at_slo(stats.input_mean, stats.output_mean, slo.tpot_s)
    decode = rate * stats.output_mean / (per_decode * UTILIZATION)
    return max(1, math.ceil(prefill - 1e-9)), max(1, math.ceil(decode - 1e-9))


@dataclass(slots=True)
class Trace:
    """Requests by arrival time; ``rate_of(t)`` is the curve they were drawn from."""

    name: str
    duration_s: float
    peak_rate: float
    arrivals: list[float]
    inputs: list[int]
    outputs: list[int]
    rate_of: Callable[[float], float]
    base_mix: Mix
    peak_mix: Mix
    warmup_s: float = 0.0

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s

    def long_share(self, t: float) -> float:
        """Share of requests drawn from ``peak_mix`` at time ``t`` (``shift`` only)."""
        if self.base_mix == self.peak_mix:
            return 0.0
        return _long_share(t - self.warmup_s, self.duration_s)


def make_trace(
    name: str,
    hours: float,
    seed: int,
    cost: CostModel,
    slo: Slo,
    peak_workers: int = 200,
    warmup_s: float = WARMUP_S,
) -> Trace:
    """The trace ``name`` (one of ``TRACES``) over ``hours`` after ``warmup_s`` at its
    starting rate (a cluster already serving; not counted), deterministic for a seed."""
    if name not in TRACES:
        raise ValueError(f"trace must be one of {TRACES}, got {name!r}")
    duration = hours * 3600.0
    rng = random.Random(f"{name}:{seed}")
    peak_mix = LONG_PROMPTS if name == "shift" else CHAT
    peak = _peak_rate(cost, MixStats.of(peak_mix, cost), slo, peak_workers)
    curve = _shape(name, duration, rng)

    def shape(x: float) -> float:
        return curve(max(0.0, x - warmup_s))

    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= warmup_s + duration:
            break
        if rng.random() * peak > peak * shape(t):
            continue
        share = _long_share(t - warmup_s, duration) if name == "shift" else 0.0
        mix = LONG_PROMPTS if share > 0 and rng.random() < share else CHAT
        i, o = mix.sample(rng)
        arrivals.append(t)
        inputs.append(i)
        outputs.append(o)
    return Trace(
        name,
        duration,
        peak,
        arrivals,
        inputs,
        outputs,
        lambda x: peak * shape(x),
        CHAT,
        peak_mix,
        warmup_s,
    )


def _peak_rate(cost: CostModel, stats: MixStats, slo: Slo, workers: int) -> float:
    """The smallest rate (to 0.1%) whose pools need at least ``workers`` workers."""
    lo, hi = 0.0, 1.0
    while sum(pool_sizes(cost, stats, slo, hi)) < workers:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(pool_sizes(cost, stats, slo, mid)) < workers else (lo, mid)
    return hi


def _shape(name: str, duration: float, rng: random.Random) -> Callable[[float], float]:
    """The rate as a fraction of the peak, over time."""
    if name == "diurnal":
        low = 0.15
        return lambda t: low + (1 - low) * (1 - math.cos(2 * math.pi * t / duration)) / 2
    if name == "bursty":
        edges = _bursts(duration, rng)
        starts = [a for a, _ in edges]

        def bursty(t: float) -> float:
            i = bisect.bisect_right(starts, t) - 1
            return 1.0 if i >= 0 and t < edges[i][1] else 0.3

        return bursty
    return lambda t: 1.0


def _bursts(duration: float, rng: random.Random) -> list[tuple[float, float]]:
    """(start, end) of each burst: off and on periods drawn in turn, off first."""
    edges: list[tuple[float, float]] = []
    t = 0.0
    while t < duration:
        t += min(max(rng.expovariate(1 / 720.0), 120.0), 2160.0)
        on = min(max(rng.expovariate(1 / 360.0), 60.0), 1080.0)
        if t < duration:
            edges.append((t, min(duration, t + on)))
        t += on
    return edges


def _long_share(t: float, duration: float) -> float:
    return min(1.0, max(0.0, (t - duration / 3) / (duration / 3)))
