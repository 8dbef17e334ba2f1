"""The autoscaling simulator: exact costs for tiny cases, deterministic traces, drain vs no
drain, and a ``--quick`` run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.autoscale_sim import cli
from pdserve.bench.autoscale_sim.baselines import ThroughputAutoscaler
from pdserve.bench.autoscale_sim.engine import Action, Simulation
from pdserve.bench.autoscale_sim.model import CostModel, Slo, capacity_profile
from pdserve.bench.autoscale_sim.traces import CHAT, MixStats, Trace, make_trace, pool_sizes

COST, SLO = CostModel(), Slo()


def trace_of(arrivals: list[float], inp: int, out: int, name: str = "t") -> Trace:
    n = len(arrivals)
    duration = max(arrivals) + 1.0
    return Trace(name, duration, 1.0, arrivals, [inp] * n, [out] * n, lambda _: 1.0, CHAT, CHAT)


def test_cost_model_exact_values() -> None:
    assert COST.prefill_s(512) == pytest.approx(512 / 1500 * (1 + 512 / 4100))
    assert COST.prefill_s(512) == pytest.approx(0.38396, abs=1e-5)  # the measured 384 ms
    assert COST.prefill_s(100, 2048) == pytest.approx(100 / 1500 * (1 + 2048 / 4100))
    assert COST.decode_step_s(0, 0) == 0.0
    assert COST.decode_step_s(2, 1000) == pytest.approx(0.044 + 2 * 0.00329 + 1000 * 1.44e-6)
    # the fitted ITL line at the goodput sweep's 544-token mean context: 44 + 4.07 ms per seq
    assert COST.itl_s(28, 544) == pytest.approx(0.044 + 28 * (0.00329 + 544 * 1.44e-6))
    assert COST.itl_s(28, 544) == pytest.approx(0.158, abs=5e-4)  # the measured 158 ms
    assert COST.transfer_s(2048) == pytest.approx(2048 * 23_040 / 3.6e9)
    assert (COST.blocks(16), COST.blocks(17)) == (1, 2)
    assert COST.kv_batch_limit(512, 64) == 1024 // 36 == 28  # "≈ 28 running 576-token seqs"
    # chat (512 / 256): 48 blocks a sequence -> 21 fit; ITL at 21 is 132 ms <= 150 ms
    assert COST.decode_batch_at_slo(512, 256, 0.150) == 21
    assert COST.decode_rate_at_slo(512, 256, 0.150) == pytest.approx(21 / COST.itl_s(21, 640))
    profile = capacity_profile(COST, 512, 256, SLO)
    assert profile.decode_max_batch_at_slo == 21
    assert profile.prefill_tokens_per_s == pytest.approx(512 / COST.prefill_s(512))
    assert profile.startup_s == pytest.approx(18.5)


def test_one_request_disaggregated_latencies_are_exact() -> None:
    sim = Simulation(trace_of([0.0], 512, 3), COST, SLO, None, {"prefill": 1, "decode": 1})
    result = sim.run()
    prefill, step = COST.prefill_s(512), COST.decode_step_s(1, 512 + 1.5)
    assert sim.recorder.ttft[0] == pytest.approx(prefill + COST.rpc_s)
    # first token at the prefill's end; 2 more tokens after the KV arrives
    assert sim.recorder.tpot[0] == pytest.approx((COST.transfer_s(512) + 2 * step) / 2)
    assert (result.good, result.failed, result.retried) == (1, 0, 0)


def test_one_request_colocated_latencies_are_exact() -> None:
    sim = Simulation(trace_of([0.0], 512, 3), COST, SLO, None, {"colocated": 1})
    sim.run()
    assert sim.recorder.ttft[0] == pytest.approx(COST.prefill_s(512) + COST.rpc_s)
    assert sim.recorder.tpot[0] == pytest.approx(COST.decode_step_s(1, 513.5))


def test_a_prefill_stalls_the_colocated_batch() -> None:
    # the second prompt arrives while the first decodes: its mixed step adds its prefill time
    arrivals = [0.0, 0.5]
    colocated = Simulation(trace_of(arrivals, 512, 40), COST, SLO, None, {"colocated": 1})
    colocated.run()
    split = Simulation(trace_of(arrivals, 512, 40), COST, SLO, None, {"prefill": 1, "decode": 1})
    split.run()
    assert colocated.recorder.tpot[0] > split.recorder.tpot[0] + COST.prefill_s(512) / 39 * 0.9


def test_traces_are_deterministic_and_sized_for_the_peak() -> None:
    a = make_trace("bursty", 0.05, 7, COST, SLO, peak_workers=30)
    b = make_trace("bursty", 0.05, 7, COST, SLO, peak_workers=30)
    c = make_trace("bursty", 0.05, 8, COST, SLO, peak_workers=30)
    assert (a.arrivals, a.inputs, a.outputs) == (b.arrivals, b.inputs, b.outputs)
    assert a.arrivals != c.arrivals
    assert sum(pool_sizes(COST, MixStats.of(CHAT, COST), SLO, a.peak_rate)) >= 30
    for name in ("steady", "diurnal", "shift"):
        t = make_trace(name, 0.02, 1, COST, SLO, peak_workers=20)
        assert t.arrivals == sorted(t.arrivals) and len(t) > 0
        assert all(
            32 <= i <= 1400 and 2 <= o <= 1024 for i, o in zip(t.inputs, t.outputs, strict=True)
        )


def _step_down(autoscaler: ThroughputAutoscaler) -> Simulation:
    """5 req/s for 400 s, then 0.5 req/s: the first decision after the drop scales in."""
    arrivals = [i / 5 for i in range(2000)] + [400 + 2 * i for i in range(200)]
    trace = trace_of(arrivals, 256, 200, "step")
    return Simulation(trace, COST, SLO, autoscaler, {"prefill": 3, "decode": 10})


def test_scale_in_without_drain_loses_requests_and_with_drain_does_not() -> None:
    budget = 100
    killed = _step_down(ThroughputAutoscaler(COST, SLO, budget, interval_s=60.0)).run()
    drained = _step_down(ThroughputAutoscaler(COST, SLO, budget, interval_s=60.0, drain=True))
    kept = drained.run()
    assert killed.lost > 0 and killed.retried >= killed.lost
    assert kept.lost == 0 and kept.failed == 0
    assert killed.ttft_ok < kept.ttft_ok  # a lost request starts again: its TTFT is late


class RemoveOnce:
    """At its first decision, removes the decode worker that holds request 0."""

    name, interval_s = "remove once", 2.0

    def __init__(self, drain: bool) -> None:
        self.drain, self.done = drain, False

    def decide(self, now: float, sim: Simulation) -> list[Action]:
        if self.done:
            return []
        self.done = True
        holder = sim.where[0]
        assert holder is not None and holder.running == 1
        return [Action("decode", remove=(holder.worker_id,), drain=self.drain)]


@pytest.mark.parametrize("drain", [True, False])
def test_removing_a_busy_decode_worker_drains_or_loses(drain: bool) -> None:
    trace = trace_of([0.0, 0.1], 128, 50)
    pools = {"prefill": 1, "decode": 2}
    result = Simulation(trace, COST, SLO, RemoveOnce(drain), pools).run()
    assert result.lost == (0 if drain else 1)
    assert result.retried == result.lost and result.failed == 0
    assert result.ttft_ok == 2 - result.lost  # started again from scratch: a late first token


def test_quick_run_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--quick", "--out", str(tmp_path), "--jobs", "1", "--no-plots"]) == 0
    text = (tmp_path / "results.md").read_text()
    assert "| trace | policy |" in text and "pdserve planner" in text
    assert "disaggregated ÷ colocated" in text and "Planner.decide" in text
    # 6 policies and 8 operating points on diurnal; the frontier table: 9 planner runs and
    # 2 baselines
    assert text.count("| diurnal |") == 6 + 8 + 9 + 2 and (tmp_path / "results.json").exists()
    assert "| trace | planner operating point |" in text
    assert "beats reactive (llm-d-like) on attainment at equal or fewer worker-hours" in text
    assert "| trace | policy |" in capsys.readouterr().out
