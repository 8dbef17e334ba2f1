"""Draining workers through the registry (what `pdserve planner` does before a Kubernetes
scale-in), against a real redis-server: a drained worker leaves the routers' list at once,
keeps its lease and load, and the drain waits for its requests, bounded."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.worker_drain import DrainConfig, RegistryDrain
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole


def _registered(registry: WorkerRegistry, *worker_ids: str) -> dict[str, int]:
    epochs = {}
    for worker_id in worker_ids:
        epoch = registry.allocate_epoch()
        info = WorkerInfo(worker_id, WorkerRole.DECODE, "127.0.0.1:1", "m", 64, 16, epoch)
        assert registry.register(info)
        epochs[worker_id] = epoch
    return epochs


def _listed(registry: WorkerRegistry) -> list[str]:
    return [w.worker_id for w in registry.list_workers()]


FAST = DrainConfig(timeout_s=10.0, settle_s=0.1, poll_s=0.05, hold_s=1.0)


def test_drain_waits_until_the_worker_reports_idle(
    redis_client: redis.Redis, keys: RedisKeys
) -> None:
    registry = WorkerRegistry(redis_client, keys, lease_s=60)
    epochs = _registered(registry, "d0", "d1")
    registry.heartbeat("d0", epochs["d0"], WorkerLoad(running=2, waiting=1))
    drain = RegistryDrain(registry, FAST)
    result: dict[str, dict[str, int]] = {}
    waiting = threading.Thread(target=lambda: result.update(left=drain.drain(["d0"])))
    waiting.start()
    deadline_s = time.monotonic() + 5
    while _listed(registry) != ["d1"]:  # the routers stop seeing it at once
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    time.sleep(0.3)
    assert waiting.is_alive(), "the drain returned while requests were running"
    # Still registered, and its heartbeats still land: they carry the load the drain reads.
    reply = registry.heartbeat("d0", epochs["d0"], WorkerLoad(running=1))
    assert reply.status.name == "OK"
    info = registry.get("d0")
    assert info is not None and info.load.running == 1
    time.sleep(0.2)
    assert waiting.is_alive()
    registry.heartbeat("d0", epochs["d0"], WorkerLoad(running=0))
    waiting.join(5)
    assert not waiting.is_alive() and result["left"] == {"d0": 0}
    assert _listed(registry) == ["d1"]  # stays out until it is removed (or the mark lapses)


def test_drain_gives_up_after_its_timeout(redis_client: redis.Redis, keys: RedisKeys) -> None:
    registry = WorkerRegistry(redis_client, keys, lease_s=60)
    epochs = _registered(registry, "d0", "d1")
    registry.heartbeat("d0", epochs["d0"], WorkerLoad(running=3))
    config = DrainConfig(timeout_s=0.3, settle_s=0.05, poll_s=0.05, hold_s=1.0)
    started_s = time.monotonic()
    left = RegistryDrain(registry, config).drain(["d0", "never-registered"])
    assert left == {"d0": 3, "never-registered": 0}
    assert 0.3 <= time.monotonic() - started_s < 3.0
    assert _listed(registry) == ["d1"]


def test_release_and_the_mark_lapsing_give_the_worker_back(
    redis_client: redis.Redis, keys: RedisKeys
) -> None:
    registry = WorkerRegistry(redis_client, keys, lease_s=60)
    _registered(registry, "d0", "d1")
    drain = RegistryDrain(registry, FAST)
    assert drain.drain(["d0", "d1"]) == {"d0": 0, "d1": 0}
    assert _listed(registry) == []
    drain.release(["d0"])
    assert _listed(registry) == ["d0"]
    # The mark expires by itself (settle + timeout + hold after the drain began; 0.2 s here).
    assert registry.cordon("d0", 0.2)
    assert _listed(registry) == []
    time.sleep(0.35)
    assert _listed(registry) == ["d0"]
    assert not registry.cordon("gone", 5.0)  # nothing registered: nothing marked
    assert redis_client.exists(keys.draining("gone")) == 0


def test_drain_config_checks() -> None:
    for bad in ({"timeout_s": -1.0}, {"poll_s": 0.0}, {"hold_s": 0.5}):
        with pytest.raises(ValueError, match="need timeout_s"):
            DrainConfig(**bad)  # type: ignore[arg-type]
