"""The model against the measurement it is calibrated on: the cluster's goodput sweep
(docs/benchmarks.md, Cluster: 512-token prompts, 64 output tokens, Poisson arrivals, SLO
TTFT 1.5 s and TPOT 150 ms; 1 prefill + 1 decode worker, or 2 colocated workers)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.autoscale_sim.distserve import CASES, poisson_trace
from pdserve.bench.autoscale_sim.engine import Simulation
from pdserve.bench.autoscale_sim.model import CostModel

SETUPS = {"1 prefill + 1 decode": {"prefill": 1, "decode": 1}, "2 colocated": {"colocated": 2}}

# (rate, setup) -> SLO met %, TTFT p50, p90 ms, TPOT p50, p90 ms (60 requests a row)
MEASURED: dict[tuple[float, str], tuple[float, float, float, float, float]] = {
    (1.0, "1 prefill + 1 decode"): (100, 399, 509, 59, 69),
    (1.0, "2 colocated"): (100, 384, 450, 57, 67),
    (2.0, "1 prefill + 1 decode"): (78, 764, 2418, 100, 129),
    (2.0, "2 colocated"): (100, 435, 744, 93, 120),
    (4.0, "1 prefill + 1 decode"): (18, 3139, 4494, 158, 175),
    (4.0, "2 colocated"): (33, 501, 1174, 160, 183),
}


@dataclass(frozen=True, slots=True)
class Row:
    rate: float
    setup: str
    model: tuple[float, float, float, float, float]
    measured: tuple[float, float, float, float, float]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def rows(cost: CostModel | None = None, requests: int = 60, repeats: int = 20) -> list[Row]:
    """Each row as measured (60 requests), over ``repeats`` seeds pooled."""
    cost = cost or CostModel()
    case = CASES[0]  # 512 / 64, TTFT 1.5 s, TPOT 150 ms
    out = []
    for (rate, setup), measured in MEASURED.items():
        good, ttft, tpot = 0, [], []
        for seed in range(repeats):
            trace = poisson_trace(case.mix, rate, requests, seed)
            sim = Simulation(trace, cost, case.slo, None, dict(SETUPS[setup]), seed)
            good += sim.run().good
            served = sim.recorder.served()
            ttft += [1000 * sim.recorder.ttft[i] for i in served]
            tpot += [1000 * sim.recorder.tpot[i] for i in served]
        ttft, tpot = ttft or [0.0], tpot or [0.0]
        model = (
            100 * good / (requests * repeats),
            _pct(ttft, 0.5),
            _pct(ttft, 0.9),
            _pct(tpot, 0.5),
            _pct(tpot, 0.9),
        )
        out.append(Row(rate, setup, model, measured))
    return out


def table(calibration: list[Row]) -> str:
    lines = [
        "| rate (req/s) | setup | SLO met: model / measured | TTFT p50 / p90 ms: model "
        "| measured | TPOT p50 / p90 ms: model | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in calibration:
        m, x = r.model, r.measured
        lines.append(
            f"| {r.rate:g} | {r.setup} | {m[0]:.0f}% / {x[0]:.0f}% | {m[1]:,.0f} / {m[2]:,.0f} "
            f"| {x[1]:,.0f} / {x[2]:,.0f} | {m[3]:.0f} / {m[4]:.0f} | {x[3]:.0f} / {x[4]:.0f} |"
        )
    return "\n".join(lines)
