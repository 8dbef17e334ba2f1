"""What a fault cost, from request records: token errors by kind, failures by status,
goodput before / lowest / after by send time, and the time until it is back."""

from __future__ import annotations

import pytest

from pdserve.bench.chaos.analysis import Outcome, Slo, TokenErrors, report, token_errors
from pdserve.bench.chaos.soak import ProcessSample, Sample, growth, vanished

SLO = Slo(ttft_s=1.0, tpot_s=0.1)
REFERENCE = {0: (1, 2, 3, 4, 5, 6)}


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ((1, 2, 3, 4, 5, 6), TokenErrors()),
        ((1, 2, 4, 5, 6), TokenErrors(lost=1)),
        ((1, 2, 3, 3, 4, 5, 6), TokenErrors(repeated=1)),
        ((1, 2, 9, 4, 5, 6), TokenErrors(changed=1)),
        ((1, 2, 3, 4, 5, 6, 6, 6), TokenErrors(repeated=2)),
        ((1, 9, 9, 9, 4, 5, 6), TokenErrors(repeated=1, changed=2)),
        ((), TokenErrors(lost=6)),
    ],
)
def test_token_errors_by_kind(tokens: tuple[int, ...], expected: TokenErrors) -> None:
    assert token_errors(tokens, REFERENCE[0]) == expected


def _ok(sent: float, ttft: float = 0.5, tokens: tuple[int, ...] = REFERENCE[0]) -> Outcome:
    first = sent + ttft
    return Outcome(0, sent, first, first + 0.05 * (len(tokens) - 1), tokens, "ok")


def test_a_fault_that_fails_and_slows_requests_then_recovers() -> None:
    # One request a second from t=0 to t=59; the fault at t=20 (lead 2 s, window 5 s):
    # requests sent in [18, 24) fail or miss the SLO, the rest are fine.
    outcomes = []
    for t in range(60):
        if 18 <= t < 21:
            outcomes.append(Outcome(0, t, None, t + 1.0, (), "UNAVAILABLE"))
        elif 21 <= t < 24:
            outcomes.append(_ok(t, ttft=3.0))  # answered, exactly, but too late
        elif t == 30:
            outcomes.append(_ok(t, tokens=(1, 2, 3, 3, 4, 5)))  # a repeat, a loss
        else:
            outcomes.append(_ok(t))
    r = report("x", outcomes, REFERENCE, SLO, fault_s=20.0, end_s=50.0, window_s=5.0, lead_s=2.0)
    assert r.requests == 37  # sent in [13, 50)
    assert r.failed == {"UNAVAILABLE": 3} and r.completed == 34
    assert r.admitted_attainment == pytest.approx(31 / 34)  # the three late ones missed
    assert r.inexact_streams == 1 and r.errors == TokenErrors(lost=1, repeated=1)
    assert r.goodput_before == 1.0  # [13, 18): all five met the SLO
    assert r.goodput_lowest == 0.0  # [19, 24)
    assert r.goodput_after == 1.0
    # The first window from which all hold 90% of before starts at 24: 4 s after the fault.
    assert r.recovery_s == pytest.approx(4.0)


def test_a_fault_nobody_notices_recovers_at_once() -> None:
    outcomes = [_ok(t) for t in range(40)]
    r = report("x", outcomes, REFERENCE, SLO, fault_s=20.0, end_s=40.0, window_s=5.0, lead_s=2.0)
    assert (r.goodput_before, r.goodput_lowest, r.goodput_after) == (1.0, 1.0, 1.0)
    assert r.recovery_s == 0.0 and r.failed == {} and r.errors.total == 0


def test_goodput_not_back_by_the_end_has_no_recovery_time() -> None:
    outcomes = [_ok(t) if t < 20 else _ok(t, ttft=3.0) for t in range(40)]
    r = report("x", outcomes, REFERENCE, SLO, fault_s=20.0, end_s=40.0, window_s=5.0, lead_s=2.0)
    assert r.goodput_after == 0.0 and r.recovery_s is None


def test_soak_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    def at(t: float, rss: float, fds: int) -> Sample:
        return Sample(
            t, {"decode-0": ProcessSample(rss, fds, 12), "gone": ProcessSample(1, 1, 1)}, 9, 1
        )

    samples = [at(0, 100, 10), at(30, 400, 40), at(60, 410, 41), at(90, 420, 40)]
    samples[-1].processes.pop("gone")
    (row,) = growth(samples, warmup_s=30)
    assert (row.name, row.rss_warm_mb, row.rss_end_mb) == ("decode-0", 400, 420)
    assert row.rss_growth == pytest.approx(0.05)
    assert (row.fds_warm, row.fds_end, row.threads_end) == (40, 40, 12)
    assert vanished(samples, warmup_s=30) == ["gone"]
