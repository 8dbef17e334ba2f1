"""SLO attainment and goodput over sliding windows (pure: no I/O, no clock of its own).

DistServe's definition: a request is *good* when it meets BOTH latency targets,

    ttft_s <= slo_ttft       and       tpot_s <= slo_tpot

and goodput is good requests per second. SLO attainment is the fraction of requests that
were good. Over a window of ``W`` seconds ending at ``now_s`` the figures cover the samples
finished in the half-open interval ``(now_s - W, now_s]``:

    goodput_rps    = good / span_s          span_s = min(W, now_s - since_s)
    request_rps    = requests / span_s      (since_s = when recording began: a router up for
    slo_attainment = good / requests         3 s has no 10 s of history to divide by)

The same windows give the token rates the autoscaler sizes pools from: prompt and output
tokens of the requests that finished, per second of span. A request refused or failed
counts with what it asked for (its prompt, and its ``max_tokens`` as output): turned-away
load is load the pools should have served.

A request that failed or was refused counts as a request that missed its SLO (the client
was not served in time); a request the client cancelled is not recorded at all. A request
with one output token per sequence has no TPOT and meets the TPOT target by definition.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class SloConfig:
    """Latency targets, goodput windows and where the router publishes its figures.

    ``redis_url`` None: the figures are only exposed at /metrics and /dashboard. The URL may
    hold a password, so it is kept out of ``repr``. ``router_id`` "" derives one from the
    host name and process id (see ``pdserve.router.observe.goodput_store.default_router_id``).
    """

    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    windows_s: tuple[float, ...] = (10.0, 60.0)
    redis_url: str | None = field(default=None, repr=False)
    redis_prefix: str = "pdserve:"
    publish_interval_s: float = 2.0
    router_id: str = ""

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(
                f"SLO targets must be > 0 ms, got ttft_ms={self.ttft_ms}, tpot_ms={self.tpot_ms}"
            )
        if not self.windows_s or min(self.windows_s) <= 0:
            raise ValueError(f"windows_s must be non-empty and > 0 s each, got {self.windows_s}")
        if not self.publish_interval_s > 0:
            raise ValueError(f"publish_interval_s must be > 0, got {self.publish_interval_s}")

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000.0

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000.0


@dataclass(slots=True, frozen=True)
class RequestSample:
    """One finished request. ``finish_s`` is on the caller's clock (``time.monotonic()``).

    ``tpot_s`` None: at most one output token per sequence. ``failed``: an error or refusal,
    which misses the SLO whatever the latencies say.
    """

    finish_s: float
    ttft_s: float
    tpot_s: float | None = None
    failed: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0  # over all sequences of the request

    def meets(self, slo: SloConfig) -> bool:
        """Both targets met (DistServe's "good" request)."""
        if self.failed or self.ttft_s > slo.ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= slo.tpot_s


@dataclass(slots=True, frozen=True)
class GoodputFigures:
    """The figures of one window; ``slo_attainment`` is None when no request finished."""

    window_s: float
    span_s: float
    requests: int
    good_requests: int
    request_rps: float
    goodput_rps: float
    slo_attainment: float | None
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_mean_s: float | None = None  # over the requests served (None: none was)
    tpot_mean_s: float | None = None  # over those with a TPOT


def tpot_s(e2e_s: float, ttft_s: float, output_tokens: float) -> float | None:
    """Time per output token after the first, or None with fewer than two tokens.

    ``output_tokens`` is per sequence; with ``n`` > 1 the router passes the mean.
    """
    if output_tokens < 2:
        return None
    return max(0.0, e2e_s - ttft_s) / (output_tokens - 1)


def goodput_figures(
    samples: Iterable[RequestSample],
    slo: SloConfig,
    now_s: float,
    window_s: float,
    since_s: float | None = None,
) -> GoodputFigures:
    """The figures over ``(now_s - window_s, now_s]``; see the module docstring."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    start_s = now_s - window_s
    requests = good = prompt_tokens = output_tokens = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    for sample in samples:
        if start_s < sample.finish_s <= now_s:
            requests += 1
            good += sample.meets(slo)
            prompt_tokens += sample.prompt_tokens
            output_tokens += sample.output_tokens
            if not sample.failed:
                ttfts.append(sample.ttft_s)
                if sample.tpot_s is not None:
                    tpots.append(sample.tpot_s)
    span_s = window_s if since_s is None else min(window_s, now_s - since_s)
    if span_s <= 0:  # asked at the very instant recording began
        return GoodputFigures(window_s, 0.0, requests, good, 0.0, 0.0, _ratio(good, requests))
    return GoodputFigures(
        window_s,
        span_s,
        requests,
        good,
        requests / span_s,
        good / span_s,
        _ratio(good, requests),
        prompt_tokens / span_s,
        output_tokens / span_s,
        _mean(ttfts),
        _mean(tpots),
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(good: int, requests: int) -> float | None:
    return good / requests if requests else None


class SlidingGoodput:
    """Recent samples, kept long enough for the longest window; figures on demand.

    The router records samples as requests finish, on one monotonic clock, so they arrive
    in ``finish_s`` order and pruning pops from the left. A sample out of order would only
    be pruned late; the figures stay right because every window checks its bounds.
    """

    def __init__(self, slo: SloConfig, since_s: float) -> None:
        self.slo = slo
        self.since_s = since_s
        self.horizon_s = max(slo.windows_s)
        self._samples: deque[RequestSample] = deque()

    def record(self, sample: RequestSample) -> None:
        self._samples.append(sample)

    def figures(self, now_s: float) -> list[GoodputFigures]:
        """One entry per configured window, in configuration order."""
        self._prune(now_s)
        return [
            goodput_figures(self._samples, self.slo, now_s, w, self.since_s)
            for w in self.slo.windows_s
        ]

    def __len__(self) -> int:
        return len(self._samples)

    def _prune(self, now_s: float) -> None:
        oldest_s = now_s - self.horizon_s
        while self._samples and self._samples[0].finish_s <= oldest_s:
            self._samples.popleft()


def window_label(window_s: float) -> str:
    """``10.0`` -> ``"10s"``, ``0.5`` -> ``"0.5s"`` (Prometheus label and Redis field suffix)."""
    return f"{window_s:g}s"


def finite_or_none(value: float | None) -> float | None:
    """None for None/NaN/inf: JSON has no NaN."""
    return value if value is not None and math.isfinite(value) else None


def attainment_gauge(figures: Sequence[GoodputFigures]) -> list[tuple[str, float]]:
    """(window label, attainment or NaN) pairs: a gauge with no requests reads NaN."""
    return [
        (window_label(f.window_s), math.nan if f.slo_attainment is None else f.slo_attainment)
        for f in figures
    ]
