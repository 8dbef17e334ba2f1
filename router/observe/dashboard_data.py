"""The JSON the ops dashboard polls (``GET /dashboard/data``), built from one router's figures.

Counters are cumulative (the page turns them into rates between polls, against ``now_s``,
the router's monotonic clock, so a throttled or virtual-time browser still gets true rates).
Latencies are milliseconds over the last ``latency_window_s``; a figure with no samples is
null. Shape::

    {"now_s", "uptime_s", "time_unix_s",
     "slo": {"ttft_ms", "tpot_ms"},
     "counters": {"requests": {outcome: n}, "prompt_tokens", "generation_tokens",
                  "prefix_hit_tokens", "kv_transfer_bytes", "kv_transfer_s"},
     "latency_ms": {"window_s", "ttft": {"p50", "p90", "p99"} | null, "itl": ... | null},
     "goodput": [{"window", "requests", "good_requests", "request_rps", "goodput_rps",
                  "slo_attainment"}],
     "pools": {role: n},
     "workers": [{"worker_id", "role", "up", "waiting", "running", "free_blocks",
                  "cached_blocks", "total_blocks", "kv_usage"}]}
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.router.observe.goodput import finite_or_none, window_label
from pdserve.router.observe.latency_window import LatencyWindow
from pdserve.router.observe.metrics import PREFIX_HIT_ROLES, ROLES, SENDER_ROLES
from pdserve.router.observe.observability import RouterObservability


async def dashboard_data(obs: RouterObservability) -> dict[str, Any]:
    """One poll's worth of figures (fetches fresh worker stats first)."""
    await obs.poller.refresh()
    now_s = obs.clock()
    pools = obs.pool_sizes()
    return {
        "now_s": now_s,
        "uptime_s": now_s - obs.started_s,
        "time_unix_s": time.time(),
        "slo": {"ttft_ms": obs.slo.ttft_ms, "tpot_ms": obs.slo.tpot_ms},
        "counters": _counters(obs),
        "latency_ms": {
            "window_s": obs.ttft_window.horizon_s,
            "ttft": _quantiles_ms(obs.ttft_window, now_s),
            "itl": _quantiles_ms(obs.itl_window, now_s),
        },
        "goodput": [_goodput(f) for f in obs.goodput_window.figures(now_s)],
        "pools": {role: pools.get(role, 0) for role in ROLES},
        "workers": _workers(obs),
    }


def _counters(obs: RouterObservability) -> dict[str, Any]:
    totals = obs.worker_totals()
    return {
        **obs.metrics.totals(),
        "prefix_hit_tokens": sum(
            t.counters.prefix_hit_tokens for t in totals if t.role in PREFIX_HIT_ROLES
        ),
        "kv_transfer_bytes": sum(
            t.counters.transfer_bytes for t in totals if t.role in SENDER_ROLES
        ),
    }


def _quantiles_ms(window: LatencyWindow, now_s: float) -> dict[str, float] | None:
    quantiles = window.quantiles(now_s)
    if quantiles is None:
        return None
    return {f"p{round(q * 100)}": v * 1000.0 for q, v in quantiles.items()}


def _goodput(f: Any) -> dict[str, Any]:
    return {
        "window": window_label(f.window_s),
        "requests": f.requests,
        "good_requests": f.good_requests,
        "request_rps": f.request_rps,
        "goodput_rps": f.goodput_rps,
        "slo_attainment": finite_or_none(f.slo_attainment),
    }


def _workers(obs: RouterObservability) -> list[dict[str, Any]]:
    snapshots = {s.worker_id: s for s in obs.worker_snapshots()}
    rows: list[dict[str, Any]] = []
    for worker in obs.directory.live_workers():
        row: dict[str, Any] = {"worker_id": worker.worker_id, "role": worker.role.value}
        snap = snapshots.get(worker.worker_id)
        row["up"] = snap is not None
        if snap is not None:
            row.update(
                waiting=snap.waiting,
                running=snap.running,
                free_blocks=snap.free_blocks,
                cached_blocks=snap.cached_blocks,
                total_blocks=snap.total_blocks,
                kv_usage=snap.kv_usage,
            )
        rows.append(row)
    return rows
