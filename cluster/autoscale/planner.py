"""The autoscaling planner: every interval, a target size for the prefill and decode pools.

Pure and deterministic: :meth:`Planner.decide` reads the caller's clock (``now_s``) and
plain observations, and keeps only a little state (the load forecaster, and per pool the
times of its last changes). Same inputs in the same order, same decisions. Applying them
(writing the pool targets, draining the chosen workers) is the caller's business.

Cost: one pass over each pool's workers (the summary, and the victim choice on scale-in),
plus constant work for the forecast: O(workers) per decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.autoscale.config import PlannerConfig
from pdserve.cluster.autoscale.forecast import LoadForecaster
from pdserve.cluster.autoscale.observations import ClusterObservation, LoadSample, summarize
from pdserve.cluster.autoscale.pool_policy import PoolDecision, PoolInputs, PoolMemory, decide_pool
from pdserve.cluster.autoscale.profile import CapacityProfile
from pdserve.cluster.autoscale.sizing import decode_demand, prefill_demand
from pdserve.cluster.pool_manager import PoolTargets


@dataclass(slots=True, frozen=True)
class PlannerDecision:
    """Both pools' decisions and the load they were sized for (``forecast``: predicted
    at now + the profile's start-up time)."""

    prefill: PoolDecision
    decode: PoolDecision
    forecast: LoadSample

    @property
    def changed(self) -> bool:
        return self.prefill.changed or self.decode.changed

    def apply_to(self, targets: PoolTargets) -> PoolTargets:
        """``targets`` with the pools this decision changed (the colocated pool kept).
        ValueError if the result could not serve (see ``PoolTargets``)."""
        return PoolTargets(
            prefill=self.prefill.replicas if self.prefill.changed else targets.prefill,
            decode=self.decode.replicas if self.decode.changed else targets.decode,
            colocated=targets.colocated,
        )


class Planner:
    """Decides pool sizes from load, a capacity profile and each pool's state.

    Call :meth:`decide` once per interval with a non-decreasing ``now_s``.
    """

    __slots__ = ("_forecaster", "_last_now_s", "_memory", "config", "profile")

    def __init__(self, config: PlannerConfig, profile: CapacityProfile) -> None:
        self.config = config
        self.profile = profile
        self._forecaster = LoadForecaster(
            config.forecast_alpha, config.forecast_beta, config.forecast_min_samples
        )
        self._memory = {"prefill": PoolMemory(), "decode": PoolMemory()}
        self._last_now_s: float | None = None

    def decide(self, now_s: float, observation: ClusterObservation) -> PlannerDecision:
        """Feed the load to the forecaster and decide both pools (O(workers))."""
        if self._last_now_s is not None and now_s < self._last_now_s:
            raise ValueError(f"now_s went back in time: {now_s} < {self._last_now_s}")
        self._last_now_s = now_s
        self._forecaster.observe(now_s, observation.load)
        # A replica ordered now serves after the start-up time: size for the load then.
        forecast = self._forecaster.predict(self.profile.startup_s)
        smoothed_now = self._forecaster.predict(0.0)
        overdue_after_s = self.profile.startup_s * self.config.startup_overdue_factor

        prefill_summary = summarize(observation.prefill.workers, now_s, overdue_after_s)
        prefill = PoolInputs(
            "prefill",
            now_s,
            observation.prefill,
            prefill_summary,
            prefill_demand(forecast, smoothed_now, observation.prefill, self.profile, self.config),
            self.config.prefill,
        )
        decode_summary = summarize(observation.decode.workers, now_s, overdue_after_s)
        decode = PoolInputs(
            "decode",
            now_s,
            observation.decode,
            decode_summary,
            decode_demand(
                forecast,
                smoothed_now,
                observation.decode,
                decode_summary,
                self.profile,
                self.config,
            ),
            self.config.decode,
        )
        return PlannerDecision(
            decide_pool(prefill, self.config, self._memory["prefill"]),
            decide_pool(decode, self.config, self._memory["decode"]),
            forecast,
        )
