"""PNG plots of a benchmark: latency CDFs per run, and throughput/goodput against rate.

matplotlib is imported inside :func:`write_plots` with the headless Agg backend, so the rest
of the benchmark does not need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.serve.config import BenchResult, RateResult

LATENCY_CDF_PNG = "latency_cdf.png"
GOODPUT_VS_RATE_PNG = "goodput_vs_rate.png"


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """Write the plots into ``out_dir``; returns the files written. The rate plot is only
    drawn for a sweep (more than one rate)."""
    plt = load_pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_latency_cdfs(plt, result.runs, out_dir / LATENCY_CDF_PNG)]
    if len(result.runs) > 1:
        written.append(_goodput_vs_rate(plt, result, out_dir / GOODPUT_VS_RATE_PNG))
    return written


def load_pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend; ValueError when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: `.venv/bin/pip install matplotlib`") from None
    matplotlib.use("Agg")  # headless: no display here
    import matplotlib.pyplot as plt

    return plt


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of samples at or below each (the empirical CDF)."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _latencies_ms(run: RateResult) -> dict[str, list[float]]:
    ok = [o for o in run.outputs if o.success]
    return {
        "TTFT": [o.ttft_s * 1e3 for o in ok],
        "TPOT": [t * 1e3 for o in ok if (t := o.tpot_s) is not None],
        "ITL": [g * 1e3 for o in ok for g in o.itl_s],
        "E2E latency": [o.e2e_s * 1e3 for o in ok],
    }


def _latency_cdfs(plt: Any, runs: Sequence[RateResult], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in runs:
        for ax, values in zip(axes.flat, _latencies_ms(run).values(), strict=True):
            if values:
                ax.step(*cdf_points(values), where="post", label=f"{run.request_rate:g} req/s")
    for ax, name in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E latency"), strict=True):
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    return _save(plt, fig, path)


def _goodput_vs_rate(plt: Any, result: BenchResult, path: Path) -> Path:
    runs = result.runs
    # Categorical x positions: a sweep may end with "inf" (all at once).
    xs = list(range(len(runs)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r.summary.request_throughput for r in runs], "o-", label="throughput")
    goodputs = [r.summary.goodput for r in runs]
    if all(g is not None for g in goodputs):
        ax.plot(xs, goodputs, "s-", label="goodput (meets every SLO)")
    offered = [(x, r.request_rate) for x, r in enumerate(runs) if math.isfinite(r.request_rate)]
    if offered:
        ax.plot(*zip(*offered, strict=True), "x:", color="gray", label="offered rate")
    ax.set_xticks(xs, [f"{r.request_rate:g}" for r in runs])
    ax.set(xlabel="request rate (req/s)", ylabel="requests/s", title=_slo_title(result))
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Grid and legend on every axes, then write ``path`` and free the figure."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _slo_title(result: BenchResult) -> str:
    slo = result.config.slo
    parts = [
        f"{name} <= {ms:g} ms"
        for name, ms in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2el_ms))
        if ms is not None
    ]
    return "goodput: " + ", ".join(parts) if parts else "throughput (no --goodput SLO given)"
