"""Markdown tables of a run: per trace and policy, the DistServe comparison, the targets."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench.autoscale_sim.decision_cost import DecisionCost
from pdserve.bench.autoscale_sim.distserve import Comparison
from pdserve.bench.autoscale_sim.frontier import Run, attainment_at, best_within, pareto
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


def planner_runs(results: Sequence[RunResult], trace: str) -> list[Run]:
    """The planner's runs on ``trace`` at every operating point (its defaults included; not
    the variants, which change what it reads)."""
    return [
        Run(r.policy, r.worker_hours, r.attainment)
        for r in results
        if r.trace == trace and (r.policy == PLANNER or r.policy.startswith(PLANNER + " at "))
    ]


def frontier_table(results: Sequence[RunResult]) -> str:
    """Per target trace, the planner's runs by worker-hours, then each baseline against
    them (see frontier.py)."""
    lines = [
        "| trace | planner operating point | worker-hours | SLO attainment | on the frontier |",
        "|---|---|---|---|---|",
    ]
    for trace in TARGET_TRACES:
        runs = planner_runs(results, trace)
        front = pareto(runs)
        for run in sorted(runs, key=lambda r: r.worker_hours):
            lines.append(
                f"| {trace} | {run.policy} | {run.worker_hours:,.1f} | {_percent(run.attainment)} "
                f"| {'yes' if run in front else 'no'} |"
            )
    lines += [
        "",
        "| trace | baseline | its worker-hours | its attainment | planner frontier at those "
        "worker-hours | best planner run within them | planner better |",
        "|---|---|---|---|---|---|---|",
    ]
    for trace, name, base, at, best in _against_baselines(results):
        at_text = "below its cheapest run" if at is None else _percent(at)
        best_text = "none" if best is None else (
            f"{best.policy}: {_percent(best.attainment)}, {best.worker_hours:,.1f} h"
        )  # fmt: skip
        better = best is not None and best.attainment > base.attainment
        lines.append(
            f"| {trace} | {name} | {base.worker_hours:,.1f} | {_percent(base.attainment)} "
            f"| {at_text} | {best_text} | {'yes' if better else 'no'} |"
        )
    return "\n".join(lines)


def _against_baselines(
    results: Sequence[RunResult],
) -> list[tuple[str, str, RunResult, float | None, Run | None]]:
    """(trace, baseline, its run, the planner frontier at its worker-hours, the best planner
    run within them) for each baseline run on a target trace."""
    rows = []
    for trace in TARGET_TRACES:
        runs = planner_runs(results, trace)
        front = pareto(runs)
        for name in BASELINES:
            for base in (r for r in results if r.trace == trace and r.policy == name):
                at = attainment_at(front, base.worker_hours)
                rows.append((trace, name, base, at, best_within(runs, base.worker_hours)))
    return rows


def targets(results: Sequence[RunResult]) -> list[str]:
    """One line per target on the diurnal and bursty traces: met or not, with figures. The
    baselines are judged against the planner's best run at no more worker-hours than theirs."""
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
        for point in planner_runs(results, trace):
            if point.policy != PLANNER:
                cut = 1 - point.worker_hours / fixed.worker_hours
                lines.append(
                    f"{trace}: {point.policy}: {_percent(point.attainment)}, {100 * cut:.1f}% "
                    "fewer worker-hours than fixed"
                )
        for name in VARIANT_ROWS:
            if name in runs:
                v = runs[name]
                lines.append(f"{trace}: {name}: {_share(v)} at {v.worker_hours:,.1f} worker-hours")
    for trace, name, base, at, best in _against_baselines(results):
        front = "below the planner's cheapest run" if at is None else _percent(at)
        if best is None:
            lines.append(
                f"{trace}: beats {name} on attainment at equal or fewer worker-hours: NOT met "
                f"(no planner run within its {base.worker_hours:,.1f} worker-hours; its "
                f"attainment {_share(base)})"
            )
            continue
        lines.append(
            f"{trace}: beats {name} on attainment at equal or fewer worker-hours: "
            f"{_met(best.attainment > base.attainment)} ({best.policy}: "
            f"{_percent(best.attainment)} at {best.worker_hours:,.1f} vs {_share(base)} at "
            f"{base.worker_hours:,.1f} "
            f"worker-hours; the frontier at {base.worker_hours:,.1f}: {front})"
        )
    return lines


def _share(r: RunResult) -> str:
    return _percent(r.attainment)


def _percent(share: float) -> str:
    return f"{100 * share:.2f}%"


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
    if any(r.policy.startswith(PLANNER + " at ") for r in results):
        parts += [frontier_table(results), ""]
    parts += [f"- {line}" for line in targets(results)]
    return "\n".join(parts) + "\n"
