"""A worker's own /metrics endpoint (worker/metrics.py), scraped over real HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.engine_stats import EngineStats, SpeculationCounts
from pdserve.engine.kv_cache.tiers import TierStats
from pdserve.proto import worker_pb2
from pdserve.worker.convert import stats_to_proto
from pdserve.worker.metrics import start_metrics_server, stats_fn_on_loop

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(url)
    assert response.status_code == 200
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stats(worker_id: str, generated_tokens: int = 0) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        worker_id=worker_id, role="prefill", waiting=3, running=2, free_blocks=48,
        cached_blocks=7, total_blocks=64, prefix_hit_tokens=160, prompt_tokens=400,
        generated_tokens=generated_tokens, transfer_bytes=1 << 20, transfers_ok=9,
        transfers_failed=1, recompute_fallbacks=2, epoch=17, peer_fetches=5,
        peer_fetched_blocks=60, peer_fetched_bytes=60 * 368_640, peer_served_blocks=12,
    )  # fmt: skip


def test_each_scrape_reads_the_stats_function_now() -> None:
    calls: list[int] = []

    def stats_fn() -> worker_pb2.WorkerStats:
        calls.append(1)
        return stats("p0", generated_tokens=10 * len(calls))

    server = start_metrics_server(0, stats_fn)
    try:
        assert calls == []  # nothing is read before the first scrape
        first = scrape(server.url)
        labels = (("role", "prefill"), ("worker", "p0"))
        assert first[("pdserve_worker_up", ())] == 1
        assert first[("pdserve_worker_waiting", labels)] == 3
        assert first[("pdserve_worker_running", labels)] == 2
        assert first[("pdserve_worker_kv_usage", labels)] == pytest.approx(16 / 64)
        assert first[("pdserve_worker_prefix_hit_tokens_total", labels)] == 160
        assert first[("pdserve_worker_kv_transfer_bytes_total", labels)] == 1 << 20
        assert first[("pdserve_worker_recompute_fallbacks_total", labels)] == 2
        for outcome, count in (("fetched", 5), ("recomputed", 2)):
            key = tuple(sorted((*labels, ("outcome", outcome))))
            assert first[("pdserve_worker_kv_peer_prefixes_total", key)] == count
        for direction, count in (("fetched", 60), ("served", 12)):
            key = tuple(sorted((*labels, ("direction", direction))))
            assert first[("pdserve_worker_kv_peer_blocks_total", key)] == count
        assert first[("pdserve_worker_kv_peer_fetched_bytes_total", labels)] == 60 * 368_640
        failed = tuple(sorted((*labels, ("result", "failed"))))
        assert first[("pdserve_worker_kv_transfers_total", failed)] == 1
        assert first[("pdserve_worker_epoch", ())] == 17
        assert first[("pdserve_worker_generated_tokens_total", labels)] == 10
        second = scrape(server.url)
        assert second[("pdserve_worker_generated_tokens_total", labels)] == 20
    finally:
        server.stop()


def test_speculation_counters_and_acceptance_length_histogram() -> None:
    decode = worker_pb2.WorkerStats(
        worker_id="d0", role="decode", spec_verify_steps=10, spec_proposed_tokens=40,
        spec_accepted_tokens=14, spec_branch_accepted_tokens=3,
        spec_acceptance_length_counts=[3, 2, 1, 2, 2],  # 0..4 accepted per chunk
    )  # fmt: skip
    server = start_metrics_server(0, lambda: decode)
    try:
        got = scrape(server.url)
    finally:
        server.stop()
    labels = (("role", "decode"), ("worker", "d0"))
    assert got[("pdserve_worker_spec_verify_steps_total", labels)] == 10
    assert got[("pdserve_worker_spec_proposed_tokens_total", labels)] == 40
    assert got[("pdserve_worker_spec_accepted_tokens_total", labels)] == 14
    assert got[("pdserve_worker_spec_branch_accepted_tokens_total", labels)] == 3
    name = "pdserve_worker_spec_acceptance_length"
    buckets = {dict(lb)["le"]: value for (n, lb), value in got.items() if n == f"{name}_bucket"}
    assert buckets == {"0.0": 3, "1.0": 5, "2.0": 6, "3.0": 8, "4.0": 10, "+Inf": 10}
    assert got[(f"{name}_count", labels)] == 10
    assert got[(f"{name}_sum", labels)] == 0 * 3 + 1 * 2 + 2 * 1 + 3 * 2 + 4 * 2 == 18


def test_a_worker_that_does_not_speculate_has_zero_counters_and_no_histogram() -> None:
    server = start_metrics_server(0, lambda: stats("p0"))
    try:
        got = scrape(server.url)
    finally:
        server.stop()
    labels = (("role", "prefill"), ("worker", "p0"))
    assert got[("pdserve_worker_spec_accepted_tokens_total", labels)] == 0
    assert not any(n.startswith("pdserve_worker_spec_acceptance_length") for n, _ in got)


def test_tier_counters_from_the_engine_are_exported_per_tier() -> None:
    tiers = TierStats(
        host_hit_tokens=48, disk_hit_tokens=16, host_stored_blocks=7, disk_stored_blocks=2,
        host_bytes_in=7000, host_bytes_out=3000, disk_bytes_in=2000, disk_bytes_out=1000,
        host_used_bytes=4000, disk_used_bytes=2000, disk_stopped=True,
    )  # fmt: skip
    engine = EngineStats(
        waiting=0, running=0, held=0, pending_admissions=0, free_blocks=8, cached_blocks=2,
        total_blocks=8, prefix_hit_tokens=80, prefix_queried_tokens=200, prompt_tokens=200,
        generated_tokens=0, speculation=SpeculationCounts(), tiers=tiers,
    )  # fmt: skip
    msg = stats_to_proto(engine, None, worker_id="c0", role="colocated", epoch=1)
    server = start_metrics_server(0, lambda: msg)
    try:
        got = scrape(server.url)
    finally:
        server.stop()
    labels = (("role", "colocated"), ("worker", "c0"))

    def at(name: str, **extra: str) -> float:
        return got[(f"pdserve_worker_{name}", tuple(sorted((*labels, *extra.items()))))]

    assert (
        at("kv_tier_hit_tokens_total", tier="host"),
        at("kv_tier_hit_tokens_total", tier="disk"),
    ) == (48, 16)
    assert at("prefix_hit_tokens_total") == 80  # tier hits included: the pool's own are 16
    assert at("kv_tier_stored_blocks_total", tier="host") == 7
    assert at("kv_tier_stored_blocks_total", tier="disk") == 2
    moved = {
        (tier, direction): at("kv_tier_bytes_total", tier=tier, direction=direction)
        for tier in ("host", "disk")
        for direction in ("in", "out")
    }
    assert moved == {("host", "in"): 7000, ("host", "out"): 3000, ("disk", "in"): 2000,
                     ("disk", "out"): 1000}  # fmt: skip
    assert (at("kv_tier_used_bytes", tier="host"), at("kv_tier_used_bytes", tier="disk")) == (
        4000,
        2000,
    )
    assert at("kv_disk_tier_stopped") == 1


def test_a_worker_without_tiers_exports_zeros() -> None:
    server = start_metrics_server(0, lambda: stats("p0"))
    try:
        got = scrape(server.url)
    finally:
        server.stop()
    labels = (("role", "prefill"), ("tier", "disk"), ("worker", "p0"))
    assert got[("pdserve_worker_kv_tier_hit_tokens_total", labels)] == 0
    assert got[("pdserve_worker_kv_disk_tier_stopped", labels[::2])] == 0


def test_a_failing_stats_function_reports_down_without_failing_the_scrape() -> None:
    def broken() -> worker_pb2.WorkerStats:
        raise RuntimeError("engine loop stopped")

    server = start_metrics_server(0, broken)
    try:
        got = scrape(server.url)
        assert got[("pdserve_worker_up", ())] == 0
        assert not any(name == "pdserve_worker_waiting" for name, _ in got)
    finally:
        server.stop()


@pytest.fixture()
def loop_in_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_two_workers_in_one_process_with_stats_on_an_event_loop(
    loop_in_thread: asyncio.AbstractEventLoop,
) -> None:
    async def stats_p1() -> worker_pb2.WorkerStats:
        await asyncio.sleep(0)  # a real coroutine, run on the worker's loop
        return stats("p1")

    a = start_metrics_server(0, lambda: stats("p0"))
    b = start_metrics_server(0, stats_fn_on_loop(stats_p1, loop_in_thread))
    try:
        assert a.port != b.port
        workers_a = {dict(lb).get("worker") for _, lb in scrape(a.url)} - {None}
        workers_b = {dict(lb).get("worker") for _, lb in scrape(b.url)} - {None}
        assert (workers_a, workers_b) == ({"p0"}, {"p1"})
    finally:
        a.stop()
        b.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(a.url)  # stop() closed the socket


def test_port_must_be_a_port() -> None:
    with pytest.raises(ValueError, match=r"metrics port must be in \[0, 65535\]"):
        start_metrics_server(70000, lambda: stats("p0"))
