"""Concurrency limit and the router's own per-worker load counts."""

from __future__ import annotations

import pytest

from pdserve.proto.workers import WorkerLoad
from pdserve.router.edge.errors import OverloadedError
from pdserve.router.state.admission import ConcurrencyLimiter, LocalLoadTracker


def test_limiter_refuses_beyond_the_limit_with_a_retry_hint() -> None:
    limiter = ConcurrencyLimiter(limit=2, retry_after_s=5)
    limiter.acquire()
    limiter.acquire()
    with pytest.raises(OverloadedError, match="2 in flight, limit 2") as caught:
        limiter.acquire()
    assert caught.value.retry_after_s == 5
    limiter.release()
    limiter.acquire()  # room again


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
