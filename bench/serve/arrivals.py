"""When requests are sent: a Poisson process at a given rate, or everything at once.

Inter-arrival gaps are drawn from a gamma distribution with shape ``burstiness`` and mean
``1 / rate``; burstiness 1 is the exponential distribution, i.e. Poisson arrivals (vLLM's
``--burstiness`` has the same meaning). Rate ``inf`` sends every request at time 0.
"""

from __future__ import annotations

import math
import random


def parse_rates(text: str) -> tuple[float, ...]:
    """``"4"`` -> (4.0,); ``"1,2,4"`` -> a sweep; ``"inf"`` -> all at once."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise ValueError(
                f"--request-rate {text!r}: {part!r} is not a number; use e.g. 4, 1,2,4 or inf"
            ) from None
        if not rate > 0:  # also refuses nan
            raise ValueError(f"--request-rate must be > 0 (or inf), got {part.strip()!r}")
        rates.append(rate)
    return tuple(rates)


def inter_arrival_s(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """``num`` independent gaps in seconds between consecutive requests."""
    if num < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {num}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(num)]
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def arrival_offsets_s(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start of the run: the first at 0, then one gap apart."""
    offsets, t = [], 0.0
    for gap in inter_arrival_s(num, rate, seed, burstiness):
        offsets.append(t)
        t += gap
    return offsets
