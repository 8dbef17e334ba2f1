"""Worker agent and router adapters against a real redis-server (no model, no Ray).

The agent's callbacks read a small in-test block cache (what an engine's KV pool reports:
stored / removed / cleared events, and its cached hashes for snapshots).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from pdserve.cluster.kv_events import KvEventSequencer, KvStored
from pdserve.cluster.locality_index import ApplyStatus, LocalityIndex
from pdserve.cluster.redis_server import RedisServer, RedisServerConfig, connect, free_loopback_port
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.router_wiring import RedisLocality, RedisWorkerDirectory, merge_after_restart
from pdserve.cluster.worker_agent import AgentConfig, WorkerAgent, start_worker_agent
from pdserve.engine.kv_cache.events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CachedBlocks,
    KVCacheEvent,
)
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole
from pdserve.router.policies import PrefixHit


class BlockCache:
    """Stands in for an engine's KV pool and tiers: hashes held (with their tiers) plus
    undrained events."""

    def __init__(self) -> None:
        self.held: dict[int, KVTier] = {}
        self.events: list[KVCacheEvent] = []
        self.lock = threading.Lock()
        self.running = 0

    def store(self, *hashes: int, tier: KVTier = KVTier.POOL) -> None:
        with self.lock:
            self.held |= dict.fromkeys(hashes, tier)
            self.events.append(BlocksStored(hashes, tier))

    def remove(self, *hashes: int) -> None:
        with self.lock:
            for h in hashes:
                self.held.pop(h, None)
            self.events.append(BlocksRemoved(hashes))

    def clear(self) -> None:
        with self.lock:
            self.held.clear()
            self.events.append(CacheCleared())

    def stats(self) -> WorkerLoad:
        return WorkerLoad(waiting=0, running=self.running, free_blocks=7)

    def drain(self) -> list[KVCacheEvent]:
        with self.lock:
            out, self.events = self.events, []
            return out

    def snapshot(self) -> CachedBlocks:
        with self.lock:
            self.events = []
            hashes = sorted(self.held)
            return CachedBlocks(tuple(hashes), tuple(self.held[h] for h in hashes))


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


FAST = dict(lease_s=1.0, heartbeat_s=0.2, publish_interval_s=0.02, redis_timeout_s=0.5)


@pytest.fixture()
def config(keys: RedisKeys) -> AgentConfig:
    return AgentConfig(key_prefix=keys.prefix, **FAST)


def advert(worker_id: str = "prefill-0", role: WorkerRole = WorkerRole.PREFILL) -> WorkerInfo:
    """What a worker registers, before the agent fills in epoch and load."""
    return WorkerInfo(worker_id, role, "127.0.0.1:1234", "m", 64, 16)


def start(
    url: str,
    cache: BlockCache,
    config: AgentConfig,
    wid: str = "prefill-0",
    role: WorkerRole = WorkerRole.PREFILL,
) -> WorkerAgent:
    ad = advert(wid, role)
    return start_worker_agent(url, ad, cache.stats, cache.drain, cache.snapshot, config)


@pytest.fixture()
def index(redis_client: redis.Redis, keys: RedisKeys) -> LocalityIndex:
    return LocalityIndex(redis_client, keys)


@pytest.fixture()
def registry(redis_client: redis.Redis, keys: RedisKeys) -> WorkerRegistry:
    return WorkerRegistry(redis_client, keys, lease_s=1.0)


def test_agent_registers_publishes_events_and_deregisters(
    redis_server: RedisServer, config: AgentConfig, index: LocalityIndex, registry: WorkerRegistry
) -> None:
    cache = BlockCache()
    cache.store(1, 2)  # held before start: goes out in the first snapshot
    agent = start(redis_server.url, cache, config)
    try:
        info = registry.get("prefill-0")
        assert info is not None and info.epoch == agent.epoch and info.role == WorkerRole.PREFILL
        assert index.blocks_of("prefill-0") == {1, 2}
        cache.store(3, 4)
        cache.remove(1)
        wait_until(lambda: index.blocks_of("prefill-0") == {2, 3, 4})
        # prefix 2,3,4 is held; 1 was evicted, so a prompt starting with block 1 has no hit
        assert index.longest_prefix([2, 3, 4, 5], ["prefill-0"]) == {"prefill-0": PrefixHit(3)}
        assert index.longest_prefix([1, 2], ["prefill-0"]) == {"prefill-0": PrefixHit(0)}
        cache.store(3, tier=KVTier.HOST)  # evicted from the pool into host memory
        cache.store(4, tier=KVTier.DISK)
        hit = PrefixHit(3, host_blocks=1, disk_blocks=1)
        wait_until(lambda: index.longest_prefix([2, 3, 4], ["prefill-0"]) == {"prefill-0": hit})
        cache.running = 3
        wait_until(lambda: registry.get("prefill-0").load.running == 3)  # type: ignore[union-attr]
        cache.clear()
        wait_until(lambda: index.blocks_of("prefill-0") == set())
    finally:
        agent.stop()
    assert registry.get("prefill-0") is None


def test_snapshot_is_sent_when_the_index_saw_a_gap(
    redis_server: RedisServer, config: AgentConfig, index: LocalityIndex
) -> None:
    cache = BlockCache()
    agent = start(redis_server.url, cache, config)
    try:
        cache.store(10)
        wait_until(lambda: index.blocks_of("prefill-0") == {10})
        # An event numbered far ahead (as if some were lost) puts the worker in "snapshot
        # awaited": lookups ignore it until the agent answers with a snapshot.
        sneaky = KvEventSequencer("prefill-0", agent.epoch)
        sneaky.last_seq = 10_000
        assert index.apply([sneaky.stored([99])]).statuses == (ApplyStatus.GAP,)
        assert index.longest_prefix([10], ["prefill-0"]) == {"prefill-0": PrefixHit(0)}
        cache.store(11)
        wait_until(
            lambda: index.longest_prefix([10, 11], ["prefill-0"]) == {"prefill-0": PrefixHit(2)}
        )
        assert index.blocks_of("prefill-0") == {10, 11}  # 99 never held: not in the snapshot
    finally:
        agent.stop()


def test_new_epoch_of_a_worker_drops_the_old_entries(
    redis_server: RedisServer, config: AgentConfig, index: LocalityIndex, registry: WorkerRegistry
) -> None:
    old_cache = BlockCache()
    old = start(redis_server.url, old_cache, config)
    old_cache.store(5, 6)
    wait_until(lambda: index.blocks_of("prefill-0") == {5, 6})
    old.stop(deregister=False)  # a crash: no goodbye
    new_cache = BlockCache()
    new = start(redis_server.url, new_cache, config)
    try:
        assert new.epoch > old.epoch
        assert index.blocks_of("prefill-0") == set()
        assert index.longest_prefix([5, 6], ["prefill-0"]) == {"prefill-0": PrefixHit(0)}
        # A late event of the dead incarnation is refused.
        late = KvStored("prefill-0", old.epoch, 99, (5,))
        assert index.apply([late]).statuses == (ApplyStatus.STALE_EPOCH,)
        assert registry.get("prefill-0").epoch == new.epoch  # type: ignore[union-attr]
    finally:
        new.stop()


def test_older_incarnation_learns_it_was_superseded(
    redis_server: RedisServer, config: AgentConfig
) -> None:
    first = start(redis_server.url, BlockCache(), config)
    second = start(redis_server.url, BlockCache(), config)
    try:
        assert first.superseded.wait(5.0)
        assert not second.superseded.is_set()
    finally:
        first.stop()  # a stale epoch cannot deregister the newer one
        second.stop()


def test_lapsed_lease_comes_back_as_a_new_incarnation(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    keys: RedisKeys,
    config: AgentConfig,
    index: LocalityIndex,
    registry: WorkerRegistry,
) -> None:
    cache = BlockCache()
    cache.store(7, 8)
    agent = start(redis_server.url, cache, config)
    try:
        first_epoch = agent.epoch
        # As if the host had been cut off past its lease: the registration is gone.
        redis_client.delete(keys.worker("prefill-0"))
        wait_until(lambda: agent.epoch > first_epoch)
        wait_until(lambda: registry.get("prefill-0") is not None)
        assert registry.get("prefill-0").epoch == agent.epoch  # type: ignore[union-attr]
        wait_until(lambda: index.blocks_of("prefill-0") == {7, 8})
        late = KvStored("prefill-0", first_epoch, 10_000, (9,))
        assert index.apply([late]).statuses == (ApplyStatus.STALE_EPOCH,)
    finally:
        agent.stop()


def test_agent_rebuilds_registration_and_index_after_redis_restart(
    keys: RedisKeys, config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_loopback_port()
    server = RedisServer(RedisServerConfig(port=port)).start()
    cache = BlockCache()
    cache.store(1, 2, 3)
    agent = start(server.url, cache, config)
    client = connect(server.url)
    try:
        caplog.set_level(logging.WARNING, logger="pdserve.agent")
        server.stop()  # everything in Redis is gone (no persistence)
        wait_until(lambda: not agent.connected)
        cache.store(4)  # happens during the outage: must still reach the index
        server = RedisServer(RedisServerConfig(port=port)).start()
        index = LocalityIndex(client, keys)
        registry = WorkerRegistry(client, keys)
        wait_until(lambda: registry.get("prefill-0") is not None)
        wait_until(lambda: index.blocks_of("prefill-0") == {1, 2, 3, 4})
        assert index.longest_prefix([1, 2, 3, 4], ["prefill-0"]) == {"prefill-0": PrefixHit(4)}
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1, [r.getMessage() for r in caplog.records]
    finally:
        agent.stop()
        client.close()
        server.stop()


def test_directory_and_locality_adapters_follow_the_registry(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    keys: RedisKeys,
    config: AgentConfig,
    registry: WorkerRegistry,
) -> None:
    index = LocalityIndex(redis_client, keys)
    directory = RedisWorkerDirectory(registry, index, refresh_s=0.05)
    locality = RedisLocality(index)
    cache = BlockCache()
    cache.store(7, 8)
    cache.running = 2
    agent = start(redis_server.url, cache, config, "decode-3", WorkerRole.DECODE)
    try:
        directory.start()
        wait_until(lambda: len(directory.live_workers()) == 1)
        (worker,) = directory.live_workers()
        assert worker.worker_id == "decode-3" and worker.role == WorkerRole.DECODE
        assert worker.address == "127.0.0.1:1234" and worker.model == "m"
        wait_until(lambda: directory.live_workers()[0].load.running == 2)
        assert directory.live_workers()[0].load.free_blocks == 7
        assert locality.longest_prefix([7, 8, 9], ["decode-3", "nobody"]) == {
            "decode-3": PrefixHit(2),
            "nobody": PrefixHit(0),
        }
        agent.stop()  # deregisters: the router stops seeing it
        wait_until(lambda: directory.live_workers() == ())
    finally:
        agent.stop()
        directory.stop()


def test_locality_falls_back_to_empty_while_redis_is_down(
    keys: RedisKeys, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_loopback_port()
    server = RedisServer(RedisServerConfig(port=port)).start()
    client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    index = LocalityIndex(client, keys)
    registry = WorkerRegistry(client, keys, lease_s=5.0)
    locality = RedisLocality(index, retry_s=0.05)
    directory = RedisWorkerDirectory(registry, index, refresh_s=0.05)
    seq = KvEventSequencer("w", registry.allocate_epoch())
    agent_info = dataclasses.replace(advert("w"), epoch=seq.epoch)
    try:
        assert registry.register(agent_info)
        index.apply([seq.stored([1, 2])])
        directory.refresh()
        assert [w.worker_id for w in directory.live_workers()] == ["w"]
        assert locality.longest_prefix([1, 2], ["w"]) == {"w": PrefixHit(2)}
        caplog.set_level(logging.WARNING, logger="pdserve.router_wiring")
        server.stop()
        for _ in range(3):
            assert locality.longest_prefix([1, 2], ["w"]) == {}
            time.sleep(0.06)
            directory.refresh()
        assert not locality.redis_ok and not directory.redis_ok
        # the last known workers stay routable while Redis is away
        assert [w.worker_id for w in directory.live_workers()] == ["w"]
        messages = [r.getMessage() for r in caplog.records]
        assert sum("unreachable" in m for m in messages) == 2, messages  # once per adapter
        server = RedisServer(RedisServerConfig(port=port)).start()
        directory.refresh()  # Redis is empty now: the old worker is kept for one lease
        assert [w.worker_id for w in directory.live_workers()] == ["w"]
        assert registry.register(agent_info)
        index.apply([seq.snapshot([1, 2])])
        time.sleep(0.06)
        assert locality.longest_prefix([1, 2], ["w"]) == {"w": PrefixHit(2)}
        assert locality.redis_ok
    finally:
        client.close()
        server.stop()


def test_merge_after_restart_keeps_missing_workers_and_prefers_fresh_entries() -> None:
    old_a = WorkerInfo("a", WorkerRole.PREFILL, "h:1")
    old_b = WorkerInfo("b", WorkerRole.DECODE, "h:2")
    new_a = WorkerInfo("a", WorkerRole.PREFILL, "h:9")
    assert merge_after_restart([new_a], [old_a, old_b]) == (new_a, old_b)
    assert merge_after_restart([], []) == ()


@pytest.fixture(autouse=True)
def _no_thread_leaks() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        leaked = {t.name for t in threading.enumerate()} - before
        if not any(name.startswith("agent-") for name in leaked):
            return
        time.sleep(0.05)
    raise AssertionError(f"agent threads still running: {leaked}")
