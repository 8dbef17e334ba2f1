"""Concurrency limit, shedding by predicted TTFT, and the router's own per-worker load
counts."""

from __future__ import annotations

import pytest

from pdserve.proto.workers import WorkerLoad
from pdserve.router.edge.errors import OverloadedError
from pdserve.router.policies.types import RouteDecision
from pdserve.router.state.admission import ConcurrencyLimiter, LocalLoadTracker, SloShedding


def test_limiter_refuses_beyond_the_limit_with_a_retry_hint() -> None:
    limiter = ConcurrencyLimiter(ceiling=2, retry_after_s=5)
    limiter.acquire()
    limiter.acquire()
    with pytest.raises(OverloadedError, match="2 in flight, limit 2") as caught:
        limiter.acquire()
    assert caught.value.retry_after_s == 5
    limiter.release()
    limiter.acquire()  # room again


def test_the_adaptive_limit_cuts_on_a_miss_and_grows_back_on_hits() -> None:
    limiter = ConcurrencyLimiter(ceiling=100, retry_after_s=1, floor=4, cooldown_s=1.0,
                                 adaptive=True)  # fmt: skip
    assert limiter.limit == 4  # it starts at the floor
    while limiter.limit < 40:  # slow start: +1 per met request while in use
        while limiter.active < limiter.limit:
            limiter.acquire()
        limiter.met()
    assert limiter.limit == 40 and limiter.active == 39
    limiter.acquire()
    limiter.missed(now_s=10.0)  # 40 in flight: the limit drops to 0.7 x 40
    assert limiter.limit == 28
    limiter.missed(now_s=10.5)  # the same overload: no second cut within the cooldown
    assert limiter.limit == 28
    with pytest.raises(OverloadedError, match="40 in flight, limit 28"):
        limiter.acquire()
    for _ in range(35):
        limiter.release()
    limiter.missed(now_s=11.0)  # 5 in flight now
    assert limiter.limit == 4  # 3.5, held at the floor
    for _ in range(4):
        limiter.met()  # +1/limit each
    assert limiter.limit == 4
    limiter.met()  # the fifth: one more request allowed
    assert limiter.limit == 5
    for _ in range(6000):  # 5 in flight: it grows to twice that and no further
        limiter.met()
    assert limiter.limit == 10
    mets = 0
    while limiter.limit < 100:  # in use: additive, from w to w + 1 takes about w hits
        while limiter.active < limiter.limit:
            limiter.acquire()
        limiter.met()
        mets += 1
    assert 4500 < mets < 5500
    for _ in range(100):
        limiter.met()
    assert limiter.limit == 100  # never past the ceiling


def test_the_adaptive_limit_stays_near_a_light_load_and_a_burst_meets_it() -> None:
    limiter = ConcurrencyLimiter(ceiling=1024, retry_after_s=1, floor=4, adaptive=True)
    for _ in range(50):  # a steady load, never more than 3 in flight, every request met
        for _ in range(3):
            limiter.acquire()
        for _ in range(3):
            limiter.met()
            limiter.release()
    assert limiter.limit <= 2 * 3 + 1  # about twice the use, far from the ceiling
    limit, admitted = limiter.limit, 0
    with pytest.raises(OverloadedError, match=f"{limit} in flight, limit {limit}"):
        for _ in range(100):  # a burst: refused past the limit before any verdict is known
            limiter.acquire()
            admitted += 1
    assert admitted == limit


def test_a_fixed_limit_ignores_the_verdicts() -> None:
    limiter = ConcurrencyLimiter(ceiling=10, retry_after_s=1)
    limiter.acquire()
    limiter.missed(now_s=0.0)
    assert limiter.limit == 10
    with pytest.raises(ValueError, match="floor <= ceiling"):
        ConcurrencyLimiter(ceiling=2, retry_after_s=1, floor=3)


def _decision(queue_s: float, ttft_s: float = 0.0) -> RouteDecision:
    return RouteDecision("p0", "d0", queue_s + ttft_s, "joint_ttft", "test", queue_s=queue_s)


def test_shedding_refuses_when_even_the_best_place_has_too_much_queued() -> None:
    shedding = SloShedding(max_wait_s=3.0)
    shedding.check([_decision(5.0), _decision(2.9)])  # the best place is in time
    shedding.check([_decision(0.0, ttft_s=60.0)])  # long, not queued: served
    shedding.check([])  # no place at all is not this rule's business
    with pytest.raises(OverloadedError, match=r"4\.5 s of work queued, past the 3\.0 s") as caught:
        shedding.check([_decision(7.0), _decision(4.5)])
    assert caught.value.retry_after_s == 2  # ceil(4.5 - 3.0)
    with pytest.raises(OverloadedError) as caught:
        shedding.check([_decision(3.01)])
    assert caught.value.retry_after_s == 1
    SloShedding(max_wait_s=0.0).check([_decision(1e9)])  # off


def test_tracker_takes_the_larger_of_reported_and_local_counts() -> None:
    tracker = LocalLoadTracker()
    tracker.start_prefill("w", prompt_tokens=100)
    tracker.start_prefill("w", prompt_tokens=50)
    tracker.start_decode("w")
    reported = WorkerLoad(waiting=1, running=4, free_blocks=9, queued_prefill_tokens=10)
    assert tracker.effective_load("w", reported) == WorkerLoad(
        waiting=2, running=4, free_blocks=9, queued_prefill_tokens=150
    )
    tracker.end_prefill("w", 100)
    tracker.end_prefill("w", 50)
    tracker.end_decode("w")
    assert tracker.effective_load("w", WorkerLoad()) == WorkerLoad()
    assert tracker.effective_load("unknown", reported) is reported
