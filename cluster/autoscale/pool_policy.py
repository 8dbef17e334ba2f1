"""One pool's decision: from its demand, workers and memory to a target size.

Order of the checks (the first that applies decides):

1. bounds: below ``min_replicas`` or above ``max_replicas`` -> straight to the bound;
2. scale-up: the forecast needs more replicas than are counted (ready + arriving), or a
   fast signal fires (KV nearly full, queue too long) with no replica arriving;
3. scale-down: the load has fitted one replica fewer, with headroom, for the sustain time;
4. otherwise hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.autoscale.config import PlannerConfig, PoolLimits
from pdserve.cluster.autoscale.observations import PoolObservation, PoolSummary
from pdserve.cluster.autoscale.sizing import PoolDemand, replicas_for
from pdserve.cluster.autoscale.victims import choose_victims


@dataclass(slots=True)
class PoolMemory:
    """What the planner keeps of one pool between decisions (times on its caller's clock)."""

    last_scale_up_s: float | None = None
    last_change_s: float | None = None
    fits_fewer_since_s: float | None = None  # start of the current "one fewer would do" run


@dataclass(slots=True, frozen=True)
class PoolDecision:
    """One pool's target after a decision.

    ``replicas``: the new target size, counted as ``plan_scale`` counts (ready + starting);
    ``current_replicas``: the size observed. Write the target only when :attr:`changed`
    (holding repeats the observed size, which may lag a target still being filled).
    ``drain_first``: on scale-in, the workers to remove, cheapest first.
    """

    role: str
    replicas: int
    current_replicas: int
    reason: str
    drain_first: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.replicas != self.current_replicas


@dataclass(slots=True, frozen=True)
class PoolInputs:
    """A pool as one decision sees it."""

    role: str
    now_s: float
    pool: PoolObservation
    summary: PoolSummary
    demand: PoolDemand
    limits: PoolLimits


def decide_pool(inputs: PoolInputs, config: PlannerConfig, memory: PoolMemory) -> PoolDecision:
    """The target for one pool; updates ``memory``. O(workers) (the victim choice)."""
    bounded = _out_of_bounds(inputs, memory)
    if bounded is not None:
        return bounded
    pressure = _pressure(inputs.summary, config)
    d = inputs.demand
    needed = replicas_for(d.up_tokens_per_s, d.replica_tokens_per_s, config.target_utilization)
    up = _scale_up(inputs, config, memory, pressure, needed)
    if up is not None:
        return up
    down = _scale_down(inputs, config, memory, pressure)
    if down is not None:
        return down
    s = inputs.summary
    load = _load_text(d, d.up_tokens_per_s)
    why = f"{load} needs {needed}; {s.ready} ready, {s.arriving} arriving"
    return _hold(inputs, why + (f"; {pressure}" if pressure else ""))


def _out_of_bounds(inputs: PoolInputs, memory: PoolMemory) -> PoolDecision | None:
    active, limits = inputs.summary.active, inputs.limits
    if active < limits.min_replicas:
        memory.last_scale_up_s = memory.last_change_s = inputs.now_s
        return _change(inputs, limits.min_replicas, f"below the minimum {limits.min_replicas}")
    if active > limits.max_replicas:
        memory.last_change_s = inputs.now_s
        return _change(inputs, limits.max_replicas, f"above the maximum {limits.max_replicas}")
    return None


def _pressure(summary: PoolSummary, config: PlannerConfig) -> str | None:
    """A fast signal, in words, or None: load the forecast has not caught up with yet."""
    if summary.kv_usage is not None and 1.0 - summary.kv_usage < config.kv_spare_min:
        return f"spare KV {1.0 - summary.kv_usage:.0%} < {config.kv_spare_min:.0%}"
    queue_per_replica = summary.waiting_requests / max(summary.ready, 1)
    if queue_per_replica > config.queue_per_replica_max:
        return (f"{summary.waiting_requests} waiting on {summary.ready} ready "
                f"(> {config.queue_per_replica_max:g} per replica)")  # fmt: skip
    return None


def _scale_up(
    inputs: PoolInputs,
    config: PlannerConfig,
    memory: PoolMemory,
    pressure: str | None,
    needed: int,
) -> PoolDecision | None:
    s, limits, now_s = inputs.summary, inputs.limits, inputs.now_s
    # Starting replicas within their start-up time are capacity on its way: a fast signal
    # only orders more when none is arriving, and the forecast is compared with them counted.
    fast = pressure is not None and s.arriving == 0
    wanted = max(needed, s.counted + 1) if fast else needed
    if wanted <= s.counted:
        return None
    memory.fits_fewer_since_s = None
    d = inputs.demand
    why = pressure if fast else f"{_load_text(d, d.up_tokens_per_s)} needs {needed}"
    counted = f"{s.ready} ready, {s.arriving} arriving" + (
        f", {s.overdue} overdue" if s.overdue else ""
    )
    if s.active >= limits.max_replicas:
        return _hold(inputs, f"at the maximum {limits.max_replicas}: {why}")
    last_s = memory.last_scale_up_s
    if not fast and last_s is not None and now_s - last_s < config.scale_up_cooldown_s:
        left_s = config.scale_up_cooldown_s - (now_s - last_s)
        return _hold(inputs, f"scale-up cooldown, {left_s:.0f} s left: {why}")
    target = min(limits.max_replicas, s.active + min(wanted - s.counted, limits.max_step_up))
    memory.last_scale_up_s = memory.last_change_s = now_s
    return _change(inputs, target, f"{why}; {counted}")


def _scale_down(
    inputs: PoolInputs, config: PlannerConfig, memory: PoolMemory, pressure: str | None
) -> PoolDecision | None:
    s, d, limits, now_s = inputs.summary, inputs.demand, inputs.limits, inputs.now_s
    attainment = inputs.pool.slo_attainment
    missing_slo = attainment is not None and attainment < config.slo_attainment_min
    utilization = config.target_utilization * (1.0 - config.scale_down_headroom)
    fits_fewer = d.down_tokens_per_s <= (s.active - 1) * d.replica_tokens_per_s * utilization
    # Never shrink while starting, under pressure or missing the SLO; and the run of
    # "one fewer would do" restarts, so a noisy load must fit for a whole sustain time.
    if s.active <= limits.min_replicas or s.starting or pressure or missing_slo or not fits_fewer:
        memory.fits_fewer_since_s = None
        return None
    if memory.fits_fewer_since_s is None:
        memory.fits_fewer_since_s = now_s
    held_s = now_s - memory.fits_fewer_since_s
    fits = f"{_load_text(d, d.down_tokens_per_s)} fits {s.active - 1}"
    if held_s < config.scale_down_sustain_s:
        return _hold(inputs, f"{fits} for {held_s:.0f} of {config.scale_down_sustain_s:.0f} s")
    last_s = memory.last_change_s
    if last_s is not None and now_s - last_s < config.scale_down_cooldown_s:
        left_s = config.scale_down_cooldown_s - (now_s - last_s)
        return _hold(inputs, f"scale-down cooldown, {left_s:.0f} s left: {fits}")
    fit = replicas_for(d.down_tokens_per_s, d.replica_tokens_per_s, utilization)
    target = max(limits.min_replicas, s.active - limits.max_step_down, fit)
    memory.last_change_s = now_s
    memory.fits_fewer_since_s = None  # the smaller pool must prove itself again
    return _change(inputs, target, f"{fits} for {held_s:.0f} s")


def _load_text(d: PoolDemand, tokens_per_s: float) -> str:
    return (f"{tokens_per_s:,.0f} {d.unit} tokens/s at {d.replica_tokens_per_s:,.0f} "
            f"per replica (correction {d.correction:.2f})")  # fmt: skip


def _hold(inputs: PoolInputs, why: str) -> PoolDecision:
    active = inputs.summary.active
    return PoolDecision(inputs.role, active, active, f"hold {active}: {why}")


def _change(inputs: PoolInputs, target: int, why: str) -> PoolDecision:
    active = inputs.summary.active
    victims = choose_victims((w for w in inputs.pool.workers if w.is_active), active - target)
    return PoolDecision(inputs.role, target, active, f"{active} -> {target}: {why}", victims)
