"""The planner's knobs: per-pool limits and the thresholds that keep decisions calm."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PoolLimits:
    """Bounds for one pool: its size, and how far one decision may move it."""

    min_replicas: int = 1
    max_replicas: int = 8
    max_step_up: int = 2
    max_step_down: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError(
                f"max_step_up and max_step_down must be >= 1, got {self.max_step_up}, "
                f"{self.max_step_down}"
            )


@dataclass(slots=True, frozen=True)
class PlannerConfig:
    """How the planner turns load into replica counts.

    Sizing: a pool gets ``ceil(demand / (capacity * target_utilization))`` replicas
    (``target_utilization`` up to 1.5: above 1 trusts the load to fit past the profile's
    capacity, which a conservative profile allows; the latency correction still applies);
    ``capacity`` is the profile's, divided by the latency correction (observed ÷ expected
    latency, clamped to ``[correction_min, correction_max]``; at least 1 while SLO attainment
    is under ``slo_attainment_min``).

    Scale-up waits ``scale_up_cooldown_s`` after the previous one, unless a fast signal
    fires: spare KV under ``kv_spare_min`` or more than ``queue_per_replica_max`` waiting
    requests per ready replica. Starting replicas count as capacity until
    ``startup_overdue_factor`` × the profile's start-up time has passed.

    Scale-down (hysteresis): only when the load fits one replica fewer at
    ``target_utilization × (1 - scale_down_headroom)``, continuously for
    ``scale_down_sustain_s``, and ``scale_down_cooldown_s`` after any change.
    """

    prefill: PoolLimits = PoolLimits()
    decode: PoolLimits = PoolLimits()
    target_utilization: float = 0.8
    scale_down_headroom: float = 0.2
    scale_down_sustain_s: float = 60.0
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    kv_spare_min: float = 0.10
    queue_per_replica_max: float = 4.0
    slo_attainment_min: float = 0.9
    correction_min: float = 0.8
    correction_max: float = 2.0
    startup_overdue_factor: float = 1.5
    forecast_alpha: float = 0.5
    forecast_beta: float = 0.1
    forecast_min_samples: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1.5:
            raise ValueError(
                f"target_utilization must be in (0, 1.5], got {self.target_utilization}"
            )
        if not 0 <= self.scale_down_headroom < 1:
            raise ValueError(
                f"scale_down_headroom must be in [0, 1), got {self.scale_down_headroom}"
            )
        durations = (self.scale_down_sustain_s, self.scale_up_cooldown_s,
                     self.scale_down_cooldown_s)  # fmt: skip
        if min(durations) < 0:
            raise ValueError(
                "sustain and cooldown times must be >= 0 s, got (scale_down_sustain_s, "
                f"scale_up_cooldown_s, scale_down_cooldown_s)={durations}"
            )
        if not (0 <= self.kv_spare_min < 1 and self.queue_per_replica_max >= 0):
            raise ValueError(
                f"need 0 <= kv_spare_min < 1 and queue_per_replica_max >= 0, got "
                f"{self.kv_spare_min}, {self.queue_per_replica_max}"
            )
        if not 0 < self.correction_min <= 1 <= self.correction_max:
            raise ValueError(
                "need 0 < correction_min <= 1 <= correction_max, got "
                f"{self.correction_min}, {self.correction_max}"
            )
        if self.startup_overdue_factor < 1:
            raise ValueError(
                f"startup_overdue_factor must be >= 1, got {self.startup_overdue_factor}"
            )

    def limits(self, role: str) -> PoolLimits:
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
