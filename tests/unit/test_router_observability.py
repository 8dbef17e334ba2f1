"""What the router's goodput windows count: served requests with their tokens, and load
it turned away with what it asked for (the autoscaler sizes the pools from these rates)."""

from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.observe.goodput import SloConfig
from pdserve.router.observe.observability import RouterObservability
from pdserve.router.state.directory import ChannelPool, StaticWorkerDirectory


def test_refused_and_failed_requests_count_their_demand_cancelled_ones_do_not() -> None:
    now = [100.0]
    config = RouterConfig(slo=SloConfig(windows_s=(10.0,)))
    obs = RouterObservability(config, StaticWorkerDirectory([]), ChannelPool(), lambda: now[0])
    now[0] += 10.0
    obs.record_failure("rejected", misses_slo=True, demand=(300, 64))  # 429: no room
    obs.record_failure("error", misses_slo=True, demand=(100, 16))
    obs.record_failure("cancelled", misses_slo=False, demand=(9_999, 9_999))
    (window,) = obs.goodput_window.figures(now[0])
    assert (window.requests, window.good_requests) == (2, 0)
    assert window.prompt_tokens_per_s == 40.0  # (300 + 100) tokens / 10 s
    assert window.output_tokens_per_s == 8.0  # (64 + 16) / 10 s
