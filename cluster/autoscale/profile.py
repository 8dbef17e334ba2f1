"""What one worker can do: the capacity profile the planner sizes pools with.

Measured, not assumed (a ``pdserve profile`` run is meant to fill it and store it as the
dict of :meth:`CapacityProfile.to_dict`):

* prefill: prompt tokens per second one prefill worker computes;
* decode: a small table of (batch size, output tokens/s, inter-token latency) points, and
  the largest batch whose ITL still meets the TPOT target (:func:`max_batch_within_itl`);
  a decode worker is sized at that batch, not at its peak throughput;
* start-up: seconds from ordering a worker to it serving (load, warm-up, register).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class DecodePoint:
    """One decode measurement: ``batch_size`` running sequences give ``tokens_per_s``
    output tokens per second in all, each sequence one token every ``itl_s``."""

    batch_size: int
    tokens_per_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if self.batch_size < 1 or not (self.tokens_per_s > 0 and self.itl_s > 0):
            raise ValueError(
                "a decode point needs batch_size >= 1, tokens_per_s > 0 and itl_s > 0, got "
                f"({self.batch_size}, {self.tokens_per_s}, {self.itl_s})"
            )


@dataclass(slots=True, frozen=True)
class CapacityProfile:
    """Per-worker capacity; ``decode_points`` sorted by batch size, sizes distinct."""

    prefill_tokens_per_s: float
    decode_points: tuple[DecodePoint, ...]
    decode_max_batch_at_slo: int
    startup_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s > 0):
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        sizes = [p.batch_size for p in self.decode_points]
        if not sizes or any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(
                f"decode_points must be non-empty with increasing batch sizes, got {sizes}"
            )
        if self.decode_max_batch_at_slo < 1:
            raise ValueError(
                f"decode_max_batch_at_slo must be >= 1, got {self.decode_max_batch_at_slo}"
            )
        if not (math.isfinite(self.startup_s) and self.startup_s >= 0):
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens/s of one decode worker at the largest batch that meets the SLO."""
        return self.decode_tokens_per_s_at(self.decode_max_batch_at_slo)

    def decode_tokens_per_s_at(self, batch_size: float) -> float:
        return _interpolate(self.decode_points, batch_size, lambda p: p.tokens_per_s)

    def itl_s_at(self, batch_size: float) -> float:
        """Expected inter-token latency with ``batch_size`` sequences running."""
        return _interpolate(self.decode_points, batch_size, lambda p: p.itl_s)

    def prefill_s(self, input_tokens: float) -> float:
        """Expected time to prefill one prompt of ``input_tokens`` on an idle worker."""
        return input_tokens / self.prefill_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for storing a measured profile."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_points": [[p.batch_size, p.tokens_per_s, p.itl_s] for p in self.decode_points],
            "decode_max_batch_at_slo": self.decode_max_batch_at_slo,
            "startup_s": self.startup_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CapacityProfile:
        """Inverse of :meth:`to_dict`; KeyError/ValueError name what is missing or wrong."""
        points = tuple(DecodePoint(int(b), float(t), float(i)) for b, t, i in data["decode_points"])
        return cls(
            prefill_tokens_per_s=float(data["prefill_tokens_per_s"]),
            decode_points=points,
            decode_max_batch_at_slo=int(data["decode_max_batch_at_slo"]),
            startup_s=float(data["startup_s"]),
        )


def max_batch_within_itl(points: Iterable[DecodePoint], itl_slo_s: float) -> int:
    """The largest measured batch size whose ITL meets ``itl_slo_s``.

    Only measured points count (no extrapolation between them: the planner should not bank
    on a batch nobody ran). ValueError when even the smallest batch misses the target.
    """
    meeting = [p.batch_size for p in points if p.itl_s <= itl_slo_s]
    if not meeting:
        raise ValueError(f"no measured decode batch meets an ITL of {itl_slo_s} s")
    return max(meeting)


def _interpolate(
    points: tuple[DecodePoint, ...], batch_size: float, value: Callable[[DecodePoint], float]
) -> float:
    """Linear between measured points; the end points' values outside them (a worker is
    not assumed to scale past what was measured)."""
    sizes = [p.batch_size for p in points]
    i = bisect.bisect_left(sizes, batch_size)
    if i == 0:
        return float(value(points[0]))
    if i == len(points):
        return float(value(points[-1]))
    lo, hi = points[i - 1], points[i]
    frac = (batch_size - lo.batch_size) / (hi.batch_size - lo.batch_size)
    return float(value(lo) + frac * (value(hi) - value(lo)))
