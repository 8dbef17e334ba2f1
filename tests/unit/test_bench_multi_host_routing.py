"""The routing part of the multi-host benchmark: its request order and its report."""

from __future__ import annotations

from pdserve.bench.multi_host_routing import (
    RoutingRun,
    RoutingSettings,
    Served,
    abba,
    format_routing_report,
)


def test_the_two_routers_alternate_so_that_neither_always_goes_first() -> None:
    assert abba(3) == ["link-aware", "link-blind", "link-blind", "link-aware",
                       "link-aware", "link-blind"]  # fmt: skip


def test_the_report_gives_each_router_its_figures_and_the_ratios() -> None:
    served = [Served("link-aware", "decode-fast", 1.0, 0.1 * (i + 1)) for i in range(10)]
    served += [Served("link-blind", "decode-slow" if i % 2 else "decode-fast", 1.0, 0.4 * (i + 1))
               for i in range(10)]  # fmt: skip
    run = RoutingRun(RoutingSettings(requests=10), tuple(served), {"decode-slow": 125e6})
    report = format_routing_report(run)
    assert "decode-fast 5, decode-slow 5" in report
    assert "decode-fast 10" in report
    assert "p90 1st->2nd token 4.00x, p90 TTFT 1.00x" in report
    assert "decode-slow 1.00 Gbit/s" in report
