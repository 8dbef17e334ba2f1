"""Side-by-side comparisons of benchmark results: Markdown tables and PNG plots.

A *series* maps a label ("1 prefill + 1 decode", "round_robin"...) to the :class:`BenchResult`
measured under it, in the order the table rows and the legend should follow. Used by
``bench/goodput_sweep.py``; plots need matplotlib (Agg backend).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.serve.config import BenchResult
from pdserve.bench.serve.metrics import SLO
from pdserve.bench.serve.plots import load_pyplot

Series = Mapping[str, BenchResult]
NA = "n/a"
ATTAINMENT_TARGET = 0.9  # "sustainable rate": the highest rate where >= 90% meet the SLO


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return NA
    return f"{value * scale:.{digits}f}"


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def slo_text(slo: SLO) -> str:
    """ "TTFT <= 2000 ms, TPOT <= 100 ms" (what a goodput figure was measured against)."""
    parts = [
        f"{name} <= {ms:g} ms"
        for name, ms in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2el_ms))
        if ms is not None
    ]
    return ", ".join(parts) if parts else "no SLO"


def sustainable_rate(result: BenchResult, attainment: float = ATTAINMENT_TARGET) -> float | None:
    """The highest offered rate whose run met the SLO for at least ``attainment`` of its
    requests (None when none did, or no SLO was set)."""
    rates = [
        run.request_rate
        for run in result.runs
        if run.summary.slo_attainment is not None and run.summary.slo_attainment >= attainment
    ]
    return max(rates, default=None)


def goodput_table(series: Series) -> str:
    """One row per (rate, setup): throughput, goodput, SLO attainment, TTFT and TPOT."""
    header = (
        "rate (req/s)", "setup", "ok / failed", "throughput (req/s)", "goodput (req/s)",
        "SLO met (%)", "TTFT p50 / p90 (ms)", "TPOT p50 / p90 (ms)",
    )  # fmt: skip
    rows = []
    for index in range(_common_run_count(series)):
        for label, result in series.items():
            run = result.runs[index]
            s = run.summary
            rows.append((
                _rate(run.request_rate), label, f"{s.completed} / {s.failed}",
                _fmt(s.request_throughput), _fmt(s.goodput), _fmt(s.slo_attainment, 100, 0),
                f"{_fmt(s.ttft.p50_ms, digits=0)} / {_fmt(s.ttft.p90_ms, digits=0)}",
                f"{_fmt(s.tpot.p50_ms, digits=0)} / {_fmt(s.tpot.p90_ms, digits=0)}",
            ))  # fmt: skip
    first = next(iter(series.values()))
    footer = [_sustainable_line(label, result) for label, result in series.items()]
    return "\n".join(
        [f"SLO: {slo_text(first.config.slo)}", "", _markdown(header, rows), "", *footer]
    )


def _sustainable_line(label: str, result: BenchResult) -> str:
    within = f">= {ATTAINMENT_TARGET:.0%} of requests within SLO"
    rate = sustainable_rate(result)
    if rate is None:
        return f"- {label}: no rate had {within}"
    return f"- {label}: highest rate with {within}: {_fmt(rate, digits=3)} req/s"


def _common_run_count(series: Series) -> int:
    if not series:
        raise ValueError("nothing to compare: no setup has results")
    counts = {len(result.runs) for result in series.values()}
    if len(counts) != 1:
        raise ValueError(f"every setup must have run the same rates, got run counts {counts}")
    return counts.pop()


def prefix_table(series: Series) -> str:
    """One row per routing policy: prefix-cache hit rate and TTFT, then ratios against the
    first policy (the baseline)."""
    header = (
        "policy", "ok / failed", "prefix-hit rate (%)", "TTFT p50 (ms)", "TTFT p90 (ms)",
        "E2E p50 (ms)", "throughput (req/s)",
    )  # fmt: skip
    rows = []
    for label, result in series.items():
        run = result.runs[0]
        s = run.summary
        rows.append((
            label, f"{s.completed} / {s.failed}", _fmt(run.server.prefix_hit_rate, 100, 1),
            _fmt(s.ttft.p50_ms, digits=0), _fmt(s.ttft.p90_ms, digits=0),
            _fmt(s.e2el.p50_ms, digits=0), _fmt(s.request_throughput),
        ))  # fmt: skip
    return "\n".join([_markdown(header, rows), "", *_prefix_ratios(series)])


def _prefix_ratios(series: Series) -> list[str]:
    if not series:
        raise ValueError("nothing to compare: no policy has results")
    (base_label, base), *others = [(k, v.runs[0]) for k, v in series.items()]
    lines = []
    for label, run in others:
        hit = _ratio(run.server.prefix_hit_rate, base.server.prefix_hit_rate)
        p90 = _ratio(base.summary.ttft.p90_ms, run.summary.ttft.p90_ms)
        vs = f"- {label} vs {base_label}"
        lines.append(f"{vs}: prefix-hit rate {_times(hit)}, TTFT p90 {_times(p90)} better")
    return lines


def _times(ratio: float | None) -> str:
    """A ratio as "2.50x"; "n/a" when a side is missing, "inf" over a zero figure."""
    if ratio is None:
        return NA
    return "inf" if math.isinf(ratio) else f"{ratio:.2f}x"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing (a run with no successful
    request has nan latencies), inf for a positive figure over a zero one."""
    if numerator is None or denominator is None or math.isnan(numerator + denominator):
        return None
    if denominator == 0:
        return math.inf if numerator > 0 else None
    return numerator / denominator


def plot_goodput_vs_rate(series: Series, path: Path) -> Path:
    """Left: goodput (solid) and throughput (dashed) against the offered rate, one colour
    per setup. Right: SLO attainment."""
    plt = load_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs0 = next(iter(series.values())).runs
    xs = list(range(_common_run_count(series)))  # categorical: a sweep may end with inf
    for label, result in series.items():
        line = left.plot(xs, [_nan(r.summary.goodput) for r in result.runs], "o-", label=label)
        colour = line[0].get_color()
        left.plot(xs, [r.summary.request_throughput for r in result.runs], "^--", color=colour,
                  alpha=0.6, label=f"{label}: throughput")  # fmt: skip
        right.plot(xs, [100 * _nan(r.summary.slo_attainment) for r in result.runs], "o-",
                   color=colour, label=label)  # fmt: skip
    finite = [
        (x, r.request_rate) for x, r in zip(xs, runs0, strict=True) if math.isfinite(r.request_rate)
    ]
    if finite:
        left.plot(*zip(*finite, strict=True), "x:", color="gray", label="offered rate")
    right.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle=":", linewidth=1)
    slo = slo_text(next(iter(series.values())).config.slo)
    left.set(ylabel="requests/s", title=f"goodput ({slo})")
    right.set(ylabel="% of requests within SLO", title="SLO attainment", ylim=(0, 105))
    for ax in (left, right):
        ax.set_xticks(xs, [_rate(r.request_rate) for r in runs0])
        ax.set(xlabel="offered request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(plt, fig, path)


def plot_prefix_routing(series: Series, path: Path) -> Path:
    """Left: prefix-cache hit rate per policy. Right: TTFT p50 and p90 per policy."""
    plt = load_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = list(series)
    runs = [series[label].runs[0] for label in labels]
    xs = list(range(len(labels)))
    hits = [100 * _nan(run.server.prefix_hit_rate) for run in runs]
    _bars(left, xs, hits, "%.1f")
    width = 0.38
    for offset, name, attr in ((-width / 2, "p50", "p50_ms"), (width / 2, "p90", "p90_ms")):
        values = [getattr(run.summary.ttft, attr) for run in runs]
        _bars(right, [x + offset for x in xs], values, "%.0f", width=width, label=f"TTFT {name}")
    left.set(ylabel="prompt tokens served from the prefix cache (%)", title="prefix-hit rate",
             ylim=(0, 105))  # fmt: skip
    right.set(ylabel="ms", title="time to first token")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.set_xticks(xs, labels)
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def _bars(ax: Any, xs: Sequence[float], values: Sequence[float], fmt: str, **kwargs: Any) -> None:
    bars = ax.bar(xs, values, **{"width": 0.6, **kwargs})
    ax.bar_label(bars, fmt=fmt, fontsize="small")


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _save(plt: Any, fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
