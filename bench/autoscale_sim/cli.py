"""``python -m pdserve.bench.autoscale_sim``: every policy on every trace, the DistServe
comparison and the planner's decision cost; tables (printed and Markdown), JSON and plots."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.autoscale_sim import calibration, decision_cost, distserve, plots, report
from pdserve.bench.autoscale_sim.metrics import RunResult
from pdserve.bench.autoscale_sim.model import CostModel
from pdserve.bench.autoscale_sim.report import TARGET_TRACES
from pdserve.bench.autoscale_sim.runner import (
    POLICIES,
    REFERENCES,
    SWEEP,
    VARIANTS,
    Setup,
    make_setup,
    run_policy,
)
from pdserve.bench.autoscale_sim.traces import TRACES


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.autoscale_sim", description=__doc__)
    p.add_argument("--trace", choices=(*TRACES, "all"), default="all")
    p.add_argument("--hours", type=float, default=2.0, help="simulated hours per trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/img/autoscale"))
    p.add_argument(
        "--peak-workers",
        type=int,
        default=200,
        help="workers the peak load needs (prefill + decode at 80%% busy)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, of {', '.join(POLICIES + VARIANTS + REFERENCES)} and "
        "planner:u=U[:b=B][:hold=S] (the planner at target utilization U, pools up to B x "
        "the peak's, scale-in after S s of fitting fewer); "
        f"default: the first four on every trace, the variants and --sweep on "
        f"{' and '.join(TARGET_TRACES)}",
    )
    p.add_argument(
        "--sweep",
        default=",".join(point.key for point in SWEEP),
        help="the planner's operating points run beside its defaults on "
        f"{' and '.join(TARGET_TRACES)} when --policies is not given ('' for none; default "
        "%(default)s)",
    )
    p.add_argument(
        "--distserve-workers",
        default="2,8,16",
        help="cluster sizes N for the DistServe comparison ('' skips it)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 2.4 simulated minutes, 12 workers at peak, N=2 only",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.hours, args.peak_workers, args.distserve_workers = 0.04, 12, "2"
    return args


@functools.lru_cache(maxsize=4)
def _setup(trace: str, hours: float, seed: int, peak_workers: int) -> Setup:
    return make_setup(trace, hours, seed, peak_workers)


@dataclasses.dataclass(frozen=True, slots=True)
class SimTask:
    trace: str
    policy: str
    hours: float
    seed: int
    peak_workers: int


@dataclasses.dataclass(frozen=True, slots=True)
class DistServeTask:
    case: int
    workers: int
    seed: int
    quick: bool


def run_task(task: SimTask | DistServeTask) -> RunResult | distserve.Comparison:
    """One simulation run or one DistServe comparison (in a worker process)."""
    if isinstance(task, SimTask):
        setup = _setup(task.trace, task.hours, task.seed, task.peak_workers)
        return run_policy(setup, task.policy)
    requests, steps = (150, 5) if task.quick else (None, 8)
    case = distserve.CASES[task.case]
    return distserve.compare(CostModel(), case, task.workers, task.seed, requests, steps)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    traces = TRACES if args.trace == "all" else (args.trace,)
    chosen = [p.strip() for p in (args.policies or "").split(",") if p.strip()]

    sweep = [p.strip() for p in args.sweep.split(",") if p.strip()]

    def policies(trace: str) -> list[str]:
        if chosen:
            return chosen
        return [*POLICIES, *((*VARIANTS, *sweep) if trace in TARGET_TRACES else ())]

    sizes = [int(n) for n in args.distserve_workers.split(",") if n.strip()]
    cost = decision_cost.measure(repeats=21 if args.quick else 201)  # before the load starts
    checked = calibration.table(calibration.rows(repeats=2 if args.quick else 20))
    tasks: list[SimTask | DistServeTask] = [
        SimTask(t, p, args.hours, args.seed, args.peak_workers) for t in traces for p in policies(t)
    ]
    tasks += [
        DistServeTask(i, n, args.seed, args.quick)
        for n in sorted(sizes, reverse=True)
        for i in range(len(distserve.CASES))
    ]
    outputs: dict[int, RunResult | distserve.Comparison] = {}
    with tqdm(total=len(tasks), desc="simulations", unit="run") as bar:
        if args.jobs <= 1:
            for i, task in enumerate(tasks):
                outputs[i] = run_task(task)
                bar.update()
        else:
            with ProcessPoolExecutor(args.jobs) as pool:
                for i, out in enumerate(pool.map(run_task, tasks)):
                    outputs[i] = out
                    bar.update()
    results = [o for o in outputs.values() if isinstance(o, RunResult)]
    comparisons = [o for o in outputs.values() if isinstance(o, distserve.Comparison)]
    comparisons.sort(key=lambda c: (c.mix, c.workers))
    write(args, results, comparisons, cost, checked)
    return 0


def write(
    args: argparse.Namespace,
    results: list[RunResult],
    comparisons: list[distserve.Comparison],
    cost: decision_cost.DecisionCost,
    checked: str,
) -> None:
    argv = f"--hours {args.hours:g} --seed {args.seed} --peak-workers {args.peak_workers}"
    header = f"Simulated ({datetime.date.today()}): `python -m pdserve.bench.autoscale_sim {argv}`."
    text = report.markdown(results, comparisons, cost, header, checked)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    data = {
        "runs": [
            {
                k: v
                for k, v in dataclasses.asdict(r).items()
                if k not in ("series", "minute_attainment", "needed")
            }
            for r in results
        ],
        "distserve": [dataclasses.asdict(c) for c in comparisons],
        "decision_cost": dataclasses.asdict(cost),
    }
    (args.out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    if args.no_plots:
        return
    swept = {r.policy for r in results if r.policy.startswith(report.PLANNER + " at ")}
    for trace in dict.fromkeys(r.trace for r in results):
        runs = [r for r in results if r.trace == trace and r.policy not in swept]
        plots.plot_trace(
            runs or [r for r in results if r.trace == trace], args.out / f"{trace}.png"
        )
    traces = [t for t in TARGET_TRACES if len(report.planner_runs(results, t)) > 1]
    if traces:
        plots.plot_frontier(results, traces, args.out / "frontier.png")
    if comparisons:
        plots.plot_distserve(comparisons, args.out / "distserve.png")
