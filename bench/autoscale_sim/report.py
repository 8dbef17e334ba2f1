"""Markdown tables of a run: per trace and policy, the DistServe comparison, the targets."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench.autoscale_sim.decision_cost import DecisionCost
from pdserve.bench.autoscale_sim.distserve import Comparison
from pdserve.bench.autoscale_sim.metrics import RunResult

TARGET_TRACES = ("diurnal", "bursty")
PLANNER, FIXED = "pdserve planner", "fixed (peak)"
BASELINES = ("reactive (llm-d-like)", "throughput (Dynamo-like)")
VARIANT_ROWS = ("pdserve planner, arrival load", "throughput (Dynamo-like) ÷ 0.8")


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "—"


def runs_table(results: Sequence[RunResult]) -> str:
    fixed = {r.trace: r.worker_hours for r in results if r.policy == FIXED}
    lines = [
        "| trace | policy | requests | SLO attainment | TTFT met | TPOT met | worker-hours "
        "| vs fixed | failed | retried | lost on scale-in | peak replicas (P + D) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = fixed.get(r.trace)
        vs = f"{100.0 * (r.worker_hours / base - 1):+.1f}%" if base else "—"
        lines.append(
            f"| {r.trace} | {r.policy} | {r.requests:,} | {_pct(r.good, r.requests)} "
            f"| {_pct(r.ttft_ok, r.requests)} | {_pct(r.tpot_ok, r.requests)} "
            f"| {r.worker_hours:,.1f} | {vs} | {r.failed:,} | {r.retried:,} | {r.lost:,} "
            f"| {r.peak} ({r.peak_prefill} + {r.peak_decode}) |"
        )
    return "\n".join(lines)


def distserve_table(rows: Sequence[Comparison]) -> str:
    lines = [
        "| mix (prompt / output tokens) | SLO TTFT / TPOT | workers N | best split P:D "
        "| disaggregated req/s per worker | colocated req/s per worker | disaggregated ÷ "
        "colocated |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        lines.append(
            f"| {c.mix} | {c.slo.ttft_s:g} s / {1000 * c.slo.tpot_s:g} ms | {c.workers} "
            f"| {c.best_prefill}:{c.workers - c.best_prefill} "
            f"| {c.disaggregated_rps / c.workers:.3f} | {c.colocated_rps / c.workers:.3f} "
            f"| {c.ratio:.2f}× |"
        )
    return "\n".join(lines)


def decision_cost_line(d: DecisionCost) -> str:
    return (
        f"`Planner.decide` with {d.workers:,} worker observations: median "
        f"{d.decide_median_ms:.3f} ms, p90 {d.decide_p90_ms:.3f} ms over {d.repeats} "
        f"decisions (building the observation: median {d.observe_median_ms:.2f} ms)."
    )


def targets(results: Sequence[RunResult]) -> list[str]:
    """One line per target on the diurnal and bursty traces: met or not, with figures."""
    lines = []
    for trace in TARGET_TRACES:
        runs = {r.policy: r for r in results if r.trace == trace}
        planner, fixed = runs.get(PLANNER), runs.get(FIXED)
        if planner is None or fixed is None:
            continue
        saved = 1 - planner.worker_hours / fixed.worker_hours
        lines.append(
            f"{trace}: attainment ≥ 99%: {_met(planner.attainment >= 0.99)} "
            f"({_share(planner)}); ≥ 30% fewer worker-hours than fixed: "
            f"{_met(saved >= 0.30)} ({100 * saved:.1f}% fewer)"
        )
        for name in BASELINES:
            other = runs.get(name)
            if other is None:
                continue
            better = planner.attainment > other.attainment
            cheaper = planner.worker_hours <= other.worker_hours
            lines.append(
                f"{trace}: beats {name} on attainment at equal or fewer worker-hours: "
                f"{_met(better and cheaper)} ({_share(planner)} vs {_share(other)}, "
                f"{planner.worker_hours:,.1f} vs {other.worker_hours:,.1f} worker-hours)"
            )
        for name in VARIANT_ROWS:
            if name in runs:
                v = runs[name]
                lines.append(f"{trace}: {name}: {_share(v)} at {v.worker_hours:,.1f} worker-hours")
    return lines


def _share(r: RunResult) -> str:
    return f"{100 * r.attainment:.2f}%"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def markdown(
    results: Sequence[RunResult],
    comparisons: Sequence[Comparison],
    cost: DecisionCost | None,
    header: str,
    calibration: str = "",
) -> str:
    parts = [header, "", runs_table(results), ""]
    if calibration:
        parts += [calibration, ""]
    if comparisons:
        parts += [distserve_table(comparisons), ""]
    if cost is not None:
        parts += [decision_cost_line(cost), ""]
    parts += [f"- {line}" for line in targets(results)]
    return "\n".join(parts) + "\n"
