"""One trace, every policy: the shared set-up (trace, sizes, profile) and one run per policy."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.autoscale_sim.baselines import (
    PlannerAutoscaler,
    ReactiveAutoscaler,
    ThroughputAutoscaler,
    planner_limits,
)
from pdserve.bench.autoscale_sim.engine import Autoscaler, Simulation
from pdserve.bench.autoscale_sim.frontier import OperatingPoint
from pdserve.bench.autoscale_sim.metrics import RunResult
from pdserve.bench.autoscale_sim.model import CostModel, Slo, capacity_profile
from pdserve.bench.autoscale_sim.oracle import OracleAutoscaler
from pdserve.bench.autoscale_sim.traces import (
    UTILIZATION,
    MixStats,
    Trace,
    make_trace,
    pool_sizes,
)
from pdserve.cluster.autoscale import CapacityProfile

POLICIES = ("fixed", "planner", "reactive", "throughput")
# Variants that answer a question about the main four (not run by default on every trace).
VARIANTS = ("planner-arrivals", "throughput-headroom")
REFERENCES = ("oracle",)  # run only when asked for (--policies)
# The planner's operating points beside its defaults (target utilization 0.8, pools up to
# twice the peak's), tracing its attainment against its worker-hours (frontier.py): down to
# the reactive baseline's worker-hours on both target traces.
SWEEP = (
    OperatingPoint(0.9),
    OperatingPoint(1.0),
    OperatingPoint(1.1),  # past the profile's capacity: it holds the SLO with room to spare
    OperatingPoint(1.1, budget=0.75),
    OperatingPoint(1.0, budget=0.7),
    OperatingPoint(1.0, budget=0.5),
    OperatingPoint(1.0, budget=0.4),
    OperatingPoint(1.0, budget=0.3),
)
POLICY_NAMES = {
    "fixed": "fixed (peak)",
    "planner": "pdserve planner",
    "reactive": "reactive (llm-d-like)",
    "throughput": "throughput (Dynamo-like)",
    "planner-arrivals": "pdserve planner, arrival load",
    "throughput-headroom": "throughput (Dynamo-like) ÷ 0.8",
    "oracle": OracleAutoscaler.name,
}


@dataclass(slots=True)
class Setup:
    """What every policy of one trace shares. ``fixed``: pools sized for the peak;
    ``initial``: pools sized for the load at time 0 (every autoscaler starts there);
    ``profile``: the planner's capacity profile, measured on the base mix."""

    trace: Trace
    cost: CostModel
    slo: Slo
    fixed: dict[str, int]
    initial: dict[str, int]
    profile: CapacityProfile
    seed: int


def make_setup(
    trace_name: str,
    hours: float,
    seed: int,
    peak_workers: int = 200,
    cost: CostModel | None = None,
    slo: Slo | None = None,
) -> Setup:
    cost, slo = cost or CostModel(), slo or Slo()
    trace = make_trace(trace_name, hours, seed, cost, slo, peak_workers)
    base, peak = MixStats.of(trace.base_mix, cost), MixStats.of(trace.peak_mix, cost)
    sizes = [pool_sizes(cost, s, slo, trace.peak_rate) for s in (base, peak)]
    fixed = {"prefill": max(p for p, _ in sizes), "decode": max(d for _, d in sizes)}
    p0, d0 = pool_sizes(cost, base, slo, trace.rate_of(trace.warmup_s))
    profile = capacity_profile(cost, base.input_mean, base.output_mean, slo)
    return Setup(trace, cost, slo, fixed, {"prefill": p0, "decode": d0}, profile, seed)


def policy_name(policy: str) -> str:
    """The name a policy key has in tables and plots."""
    point = OperatingPoint.parse(policy)
    return point.name if point is not None else POLICY_NAMES[policy]


def make_autoscaler(policy: str, setup: Setup) -> Autoscaler | None:
    if policy == "fixed":
        return None
    point = OperatingPoint.parse(policy)
    if point is not None:
        limits = planner_limits(setup.fixed, point.budget)
        return PlannerAutoscaler(
            setup.profile,
            limits,
            target_utilization=point.target_utilization,
            scale_down_sustain_s=point.hold_s,
        )
    if policy in ("planner", "planner-arrivals"):
        load = "arrivals" if policy == "planner-arrivals" else "goodput"
        return PlannerAutoscaler(setup.profile, planner_limits(setup.fixed), load=load)
    if policy == "reactive":
        return ReactiveAutoscaler()
    if policy in ("throughput", "throughput-headroom"):
        budget = 2 * (setup.fixed["prefill"] + setup.fixed["decode"])
        u = UTILIZATION if policy == "throughput-headroom" else 1.0
        return ThroughputAutoscaler(setup.cost, setup.slo, budget, utilization=u)
    if policy == "oracle":
        warmup = setup.trace.warmup_s
        return OracleAutoscaler(lambda now: needed_series(setup, [now - warmup])[0][1:])
    raise ValueError(
        f"policy must be one of {POLICIES + VARIANTS + REFERENCES} or "
        f"planner:u=U[:b=B][:hold=S], got {policy!r}"
    )


def run_policy(setup: Setup, policy: str) -> RunResult:
    autoscaler = make_autoscaler(policy, setup)
    pools = setup.fixed if autoscaler is None else setup.initial
    sim = Simulation(setup.trace, setup.cost, setup.slo, autoscaler, dict(pools), setup.seed)
    result = sim.run()
    result.policy = policy_name(policy)
    result.needed = needed_series(setup, [t for t, *_ in result.series])
    return result


def needed_series(setup: Setup, times: list[float]) -> list[tuple[float, int, int]]:
    """(time, prefill, decode) sized for the trace's rate and mix at each time (from the
    end of the warm-up, as the samples are)."""
    cost, slo, trace = setup.cost, setup.slo, setup.trace
    stats = [MixStats.of(m, cost) for m in (trace.base_mix, trace.peak_mix)]
    out = []
    for x in times:
        t = x + trace.warmup_s
        share = trace.long_share(t)
        rate = trace.rate_of(t)
        a = pool_sizes(cost, stats[0], slo, rate * (1 - share)) if share < 1 else (0, 0)
        b = pool_sizes(cost, stats[1], slo, rate * share) if share > 0 else (0, 0)
        out.append((x, a[0] + b[0], a[1] + b[1]))
    return out
