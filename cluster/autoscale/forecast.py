"""Load forecasting: Holt's linear trend over the samples of past decisions.

Pure and clocked by the caller: each sample comes with its time, so the intervals between
decisions need not be regular. While fewer than ``min_samples`` samples exist the trend
means nothing yet, and the forecast is the last observed value.
"""

from __future__ import annotations

import math

from pdserve.cluster.autoscale.observations import LoadSample


class HoltForecaster:
    """Double exponential smoothing of one series, with time-aware steps.

    On a sample ``x`` at ``t_s``, ``dt_s`` after the previous one::

        level' = alpha * x + (1 - alpha) * (level + trend * dt_s)
        trend' = beta * (level' - level) / dt_s + (1 - beta) * trend     (per second)

    ``predict(h)`` = ``level + trend * h``, never below 0 (a load is not negative). A
    small ``beta`` keeps noise from turning into a trend the planner would chase.
    """

    __slots__ = (
        "_last_t_s",
        "_last_value",
        "_level",
        "_samples",
        "_trend_per_s",
        "alpha",
        "beta",
        "min_samples",
    )

    def __init__(self, alpha: float = 0.5, beta: float = 0.1, min_samples: int = 3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1 and min_samples >= 1):
            raise ValueError(
                "need 0 < alpha <= 1, 0 <= beta <= 1 and min_samples >= 1, got "
                f"alpha={alpha}, beta={beta}, min_samples={min_samples}"
            )
        self.alpha, self.beta, self.min_samples = alpha, beta, min_samples
        self._level = self._trend_per_s = self._last_t_s = self._last_value = 0.0
        self._samples = 0

    @property
    def samples(self) -> int:
        return self._samples

    def observe(self, t_s: float, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"forecast samples must be finite, got {value}")
        if self._samples == 0:
            self._level, self._trend_per_s = value, 0.0
        else:
            dt_s = t_s - self._last_t_s
            if dt_s < 0:
                raise ValueError(f"samples must come in time order: {t_s} < {self._last_t_s}")
            prior = self._level + self._trend_per_s * dt_s
            level = self.alpha * value + (1 - self.alpha) * prior
            if dt_s > 0:  # two samples at one instant say nothing about the slope
                slope_per_s = (level - self._level) / dt_s
                self._trend_per_s = self.beta * slope_per_s + (1 - self.beta) * self._trend_per_s
            self._level = level
        self._last_t_s, self._last_value = t_s, value
        self._samples += 1

    def predict(self, horizon_s: float = 0.0) -> float:
        """The value expected ``horizon_s`` after the last sample (0 before any)."""
        if self._samples < self.min_samples:
            return self._last_value
        return max(0.0, self._level + self._trend_per_s * horizon_s)


class LoadForecaster:
    """Forecasts the three figures of a :class:`LoadSample`, each on its own.

    The mean token counts are only updated from windows that saw requests: an idle window
    has no mean, and a 0 there would drag the prediction down for the next burst.
    """

    __slots__ = ("_input_tokens", "_output_tokens", "_rate")

    def __init__(self, alpha: float = 0.5, beta: float = 0.1, min_samples: int = 3) -> None:
        self._rate = HoltForecaster(alpha, beta, min_samples)
        self._input_tokens = HoltForecaster(alpha, beta, min_samples)
        self._output_tokens = HoltForecaster(alpha, beta, min_samples)

    def observe(self, t_s: float, sample: LoadSample) -> None:
        self._rate.observe(t_s, sample.request_rate_per_s)
        if sample.request_rate_per_s > 0:
            self._input_tokens.observe(t_s, sample.mean_input_tokens)
            self._output_tokens.observe(t_s, sample.mean_output_tokens)

    def predict(self, horizon_s: float = 0.0) -> LoadSample:
        """The load expected ``horizon_s`` after the last sample; ``predict(0)`` is the
        smoothed load now."""
        return LoadSample(
            self._rate.predict(horizon_s),
            self._input_tokens.predict(horizon_s),
            self._output_tokens.predict(horizon_s),
        )
