"""Plots (matplotlib, Agg): per trace, replicas per pool and SLO attainment over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.autoscale_sim.distserve import Comparison
from pdserve.bench.autoscale_sim.frontier import pareto
from pdserve.bench.autoscale_sim.metrics import RunResult
from pdserve.bench.autoscale_sim.report import PLANNER, planner_runs

STYLES = {  # (color, line style)
    "fixed (peak)": ("tab:gray", "-"),
    "pdserve planner": ("tab:blue", "-"),
    "reactive (llm-d-like)": ("tab:orange", "-"),
    "throughput (DynamO-like)".replace("O", "o"): ("tab:green", "-"),
    "pdserve planner, arrival load": ("tab:purple", "--"),
    "throughput (Dynamo-like) ÷ 0.8": ("tab:red", "--"),
    "reactive oracle (knows the rate)": ("black", "-."),
}


def plot_trace(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (prefill, decode, slo) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    needed = results[0].needed
    if needed:
        hours = [t / 3600 for t, _, _ in needed]
        prefill.plot(hours, [p for _, p, _ in needed], "k:", lw=1, label="needed (rate)")
        decode.plot(hours, [d for _, _, d in needed], "k:", lw=1, label="needed (rate)")
    for r in results:
        color, line = STYLES.get(r.policy, (None, "-"))
        style = {"color": color, "ls": line, "lw": 1.2, "label": r.policy}
        hours = [t / 3600 for t, *_ in r.series]
        prefill.plot(hours, [s[1] for s in r.series], **style)
        decode.plot(hours, [s[2] for s in r.series], **style)
        minutes = [(m + 0.5) / 60 for m, a in enumerate(r.minute_attainment) if a is not None]
        values = [100 * a for a in r.minute_attainment if a is not None]
        slo.plot(minutes, values, **style)
    prefill.set_ylabel("prefill workers")
    decode.set_ylabel("decode workers")
    slo.set_ylabel("SLO met (%), by arrival minute")
    slo.set_xlabel("simulated hours")
    slo.set_ylim(-2, 102)
    prefill.legend(fontsize=8, loc="upper left")
    prefill.set_title(f"{results[0].trace}: workers (starting, ready, draining) and SLO")
    for ax in (prefill, decode, slo):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(results: Sequence[RunResult], traces: Sequence[str], path: Path) -> None:
    """Per trace, SLO attainment against worker-hours: the planner's operating points (its
    frontier as a line) and every other policy as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        runs = planner_runs(results, trace)
        front = pareto(runs)
        ax.plot([r.worker_hours for r in front], [100 * r.attainment for r in front], "-",
                color="tab:blue", lw=1, label="pdserve planner: frontier")  # fmt: skip
        ax.plot([r.worker_hours for r in runs], [100 * r.attainment for r in runs], "o",
                color="tab:blue", ms=4)  # fmt: skip
        for r in runs:
            label = r.policy.removeprefix("pdserve planner at ") if r.policy != PLANNER else "80%"
            ax.annotate(label.replace(", pools ≤ ", "\n≤ "), (r.worker_hours, 100 * r.attainment),
                        fontsize=6, xytext=(3, -9), textcoords="offset points")  # fmt: skip
        names = {r.policy for r in runs}
        for other in results:
            if other.trace == trace and other.policy not in names:
                color, _ = STYLES.get(other.policy, ("black", "-"))
                ax.plot(other.worker_hours, 100 * other.attainment, "s", color=color,
                        label=other.policy)  # fmt: skip
        ax.set_title(f"{trace}: SLO attainment against worker-hours")
        ax.set_xlabel("worker-hours")
        ax.set_ylabel("SLO met (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distserve(rows: Sequence[Comparison], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.mix}\nN={c.workers}" for c in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar(
        [i - 0.2 for i in x],
        [c.disaggregated_rps / c.workers for c in rows],
        0.4,
        label="disaggregated, best P:D",
    )
    ax.bar(
        [i + 0.2 for i in x], [c.colocated_rps / c.workers for c in rows], 0.4, label="colocated"
    )
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("goodput per worker (req/s, ≥ 90% in SLO)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
