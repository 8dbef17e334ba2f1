"""Latency distributions, throughput and SLO goodput over a run's request outputs.

Percentiles interpolate linearly between order statistics (numpy's default method).
Goodput follows DistServe: completed requests per second that meet EVERY given SLO. A request
with one output token has no TPOT and is not held to the TPOT SLO. SLO attainment is the
fraction of all sent requests (failed ones included, as misses) that meet the SLOs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.serve.outputs import RequestOutput

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; nan for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100  # fractional index into the sorted values
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True, frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds (nan when there were no samples)."""

    count: int
    mean_ms: float
    std_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float


def distribution(values_s: Sequence[float]) -> Distribution:
    """Mean, standard deviation (population) and percentiles of latencies in seconds."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return Distribution(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Distribution(len(ms), statistics.fmean(ms), statistics.pstdev(ms), p50, p90, p99)


@dataclass(slots=True, frozen=True)
class SLO:
    """Latency objectives in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def parse_goodput(parts: Sequence[str]) -> SLO:
    """``["ttft:200", "tpot:50"]`` (milliseconds) -> SLO(ttft_ms=200, tpot_ms=50)."""
    values: dict[str, float] = {}
    for part in parts:
        key, sep, value = part.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput {part!r}: expected KEY:MS with KEY one of {SLO_KEYS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {part!r}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"--goodput {part!r}: the SLO must be > 0 ms")
        values[f"{key}_ms"] = ms
    return SLO(**values)


def meets_slo(out: RequestOutput, slo: SLO) -> bool:
    """True when ``out`` succeeded and is within every SLO that is set."""
    if not out.success:
        return False
    tpot_s = out.tpot_s
    checks = (
        (slo.ttft_ms, out.ttft_s),
        (slo.tpot_ms, tpot_s if tpot_s is not None else 0.0),
        (slo.e2el_ms, out.e2e_s),
    )
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


@dataclass(slots=True, frozen=True)
class Summary:
    """Everything measured about one run (one request rate)."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting every SLO; None without --goodput
    slo_attainment: float | None  # fraction of sent requests meeting every SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution


def summarize(outputs: Sequence[RequestOutput], duration_s: float, slo: SLO) -> Summary:
    """Aggregate request outputs of a run that took ``duration_s`` seconds of wall time."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_tokens for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    good = sum(meets_slo(o, slo) for o in outputs) if slo.is_set else None
    return Summary(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=None if good is None else good / duration_s,
        slo_attainment=None if good is None or not outputs else good / len(outputs),
        ttft=distribution([o.ttft_s for o in ok]),
        tpot=distribution([t for o in ok if (t := o.tpot_s) is not None]),
        itl=distribution([gap for o in ok for gap in o.itl_s]),
        e2el=distribution([o.e2e_s for o in ok]),
    )
