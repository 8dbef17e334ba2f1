"""Recent latency samples and their percentiles, for the live dashboard (pure).

Prometheus histograms answer percentiles only to bucket resolution and only through a
query engine; the dashboard wants exact p50/p90/p99 of the last few seconds from the router
itself. ``LatencyWindow`` keeps ``(time_s, value_s)`` pairs for ``horizon_s`` and at most
``max_samples`` of them (a long generation adds one inter-token gap per chunk).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

DEFAULT_QUANTILES = (0.5, 0.9, 0.99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method).

    ``sorted_values`` must be sorted ascending and non-empty; ``q`` in [0, 1].
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


class LatencyWindow:
    """``(time_s, value_s)`` samples of the last ``horizon_s`` seconds."""

    def __init__(self, horizon_s: float, max_samples: int = 50_000) -> None:
        if horizon_s <= 0 or max_samples < 1:
            raise ValueError(
                f"horizon_s must be > 0 and max_samples >= 1, got {horizon_s}, {max_samples}"
            )
        self.horizon_s = horizon_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, time_s: float, value_s: float) -> None:
        self._samples.append((time_s, value_s))

    def add_many(self, time_s: float, values_s: Iterable[float]) -> None:
        self._samples.extend((time_s, v) for v in values_s)

    def quantiles(
        self, now_s: float, qs: Sequence[float] = DEFAULT_QUANTILES
    ) -> dict[float, float] | None:
        """``{q: value_s}`` over samples in ``(now_s - horizon_s, now_s]``; None if none."""
        start_s = now_s - self.horizon_s
        while self._samples and self._samples[0][0] <= start_s:
            self._samples.popleft()
        values = sorted(v for t, v in self._samples if t <= now_s)
        if not values:
            return None
        return {q: percentile(values, q) for q in qs}
