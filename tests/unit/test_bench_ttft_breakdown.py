"""The arithmetic of bench/ttft_breakdown.py: phases, medians, shares, the side-by-side table."""

from __future__ import annotations

import pytest

from pdserve.bench.ttft_breakdown import format_table, make_sample, summarize


def _times(prefill_s: float, transfer_s: float, first_step_s: float) -> dict[str, float]:
    return {"prefill_s": prefill_s, "transfer_s": transfer_s, "first_step_s": first_step_s}


def test_queue_is_what_the_worker_phases_leave_of_the_ttft() -> None:
    sample = make_sample("disaggregated", 512, 1.0, 0.7, _times(0.6, 0.1, 0.05))
    assert sample.queue_s == pytest.approx(0.25)
    assert (sample.prefill_s, sample.transfer_s, sample.first_step_s) == (0.6, 0.1, 0.05)
    assert (sample.ttft_s, sample.client_ttft_s) == (1.0, 0.7)


def test_summary_takes_medians_per_mode_and_length_and_the_median_transfer_share() -> None:
    samples = [
        make_sample("disaggregated", 128, ttft, ttft, _times(0.5, transfer, 0.1))
        for ttft, transfer in ((1.0, 0.1), (2.0, 0.1), (1.0, 0.3))
    ]
    samples.append(make_sample("colocated", 128, 0.8, 0.7, _times(0.6, 0.0, 0.1)))
    disagg, colocated = summarize(samples)
    assert (disagg.mode, disagg.tokens, disagg.repeats) == ("disaggregated", 128, 3)
    assert disagg.median_ms["ttft"] == pytest.approx(1000.0)
    assert disagg.median_ms["transfer"] == pytest.approx(100.0)
    assert disagg.transfer_pct == pytest.approx(10.0)  # shares 10%, 5%, 30%
    assert colocated.mode == "colocated" and colocated.transfer_pct == 0.0
    table = format_table([disagg, colocated])
    disagg_row = next(line for line in table.splitlines() if "disaggregated" in line)
    assert disagg_row.split()[-1] == "1.25"  # 1000 ms / 800 ms


def test_rows_are_grouped_by_length_disaggregated_first() -> None:
    samples = [
        make_sample(mode, tokens, 1.0, 0.5, _times(0.4, 0.0, 0.1))
        for tokens in (2048, 128)
        for mode in ("colocated", "disaggregated")
    ]
    order = [(s.tokens, s.mode) for s in summarize(samples)]
    assert order == [
        (128, "disaggregated"),
        (128, "colocated"),
        (2048, "disaggregated"),
        (2048, "colocated"),
    ]
