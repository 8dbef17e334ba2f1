"""The router's link-aware switch: off, routing gets no measured link rates (every pair is
priced at the cost model's default), though the rates are still measured."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CostModel, RouteRequest
from pdserve.router.policies.cost import link_bytes_per_s
from pdserve.router.request.lifecycle import RequestLifecycle
from pdserve.router.request.types import GenerateInput
from pdserve.router.state.link_rates import LinkRates

SLOW_BYTES_PER_S = 1e6


def _route_request(link_aware: bool) -> RouteRequest:
    rates = LinkRates(min_bytes=1)
    rates.observe("p0", "d0", 10**6, 1.0, now_s=time.monotonic())
    config = RouterConfig(link_aware=link_aware)
    lifecycle = RequestLifecycle(config, None, None, link_rates=rates)  # type: ignore[arg-type]
    inp = GenerateInput("r0", "m", tuple(range(64)), SamplingParams(), time.monotonic())
    request, _hashes = asyncio.run(lifecycle._route_request(inp, ["p0", "d0", "d1"]))
    assert rates.rates(time.monotonic()) == {("p0", "d0"): SLOW_BYTES_PER_S}, "still measured"
    return request


@pytest.mark.parametrize("link_aware", [True, False])
def test_routing_sees_the_measured_rates_only_when_link_aware(link_aware: bool) -> None:
    request = _route_request(link_aware)
    cost = CostModel()
    slow = link_bytes_per_s(request, "p0", "d0", cost)
    if link_aware:
        assert request.link_rates == {("p0", "d0"): SLOW_BYTES_PER_S}
        assert slow == SLOW_BYTES_PER_S
    else:
        assert request.link_rates == {}
        assert slow == link_bytes_per_s(request, "p0", "d1", cost) == cost.link_bytes_per_s


def test_link_aware_is_the_default() -> None:
    assert RouterConfig().link_aware
