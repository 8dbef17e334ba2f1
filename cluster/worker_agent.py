"""A worker's link to Redis: registration under a lease, heartbeats with load, KV events.

One background thread per worker process does, every ``publish_interval_s``::

    heartbeat due?  -> heartbeat(load)   OK | LEASE_LOST -> new epoch, register + snapshot
                                         | SUPERSEDED
    snapshot owed?  -> snapshot_fn()  -> KvSnapshot (replaces the worker's index entries;
                                         each block with its tier: pool, host, disk)
    else            -> drain_fn()     -> KvStored / KvRemoved / KvCleared, numbered by epoch+seq

The thread never calls into the engine itself: the three callbacks do (see
:func:`pdserve.worker.engine_callbacks.engine_callbacks` for an ``AsyncEngine``), and they must be
callable from this thread. While Redis is unreachable the agent logs once, drops the drained events
and owes a snapshot; when Redis answers again the heartbeat says LEASE_LOST (restarted, or the
lease lapsed while this host was cut off) or OK, and the snapshot brings the index back in line
either way. After LEASE_LOST the worker registers as a new incarnation (a new epoch): the router
and the index forgot it, and events numbered under the old epoch are refused from then on.

Usage from a worker process (after the model is loaded and warm, so the registry only lists
workers that can serve)::

    agent = start_worker_agent(redis_url, info, *engine_callbacks(async_engine, loop))
    ...
    agent.stop()  # deregister: the router stops routing here within its refresh period
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import redis

from pdserve.cluster.kv_events import KvEvent, KvEventSequencer
from pdserve.cluster.locality_index import ApplyStatus, LocalityIndex
from pdserve.cluster.registry import HeartbeatStatus, WorkerRegistry
from pdserve.engine.kv_cache.events import BlocksRemoved, BlocksStored, CacheCleared, KVCacheEvent
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad
from pdserve.worker.engine_callbacks import DrainFn, SnapshotFn, StatsFn

log = logging.getLogger("pdserve.agent")


@dataclass(slots=True, frozen=True)
class AgentConfig:
    key_prefix: str = "pdserve:"
    lease_s: float = 5.0
    heartbeat_s: float = 1.0
    publish_interval_s: float = 0.05
    redis_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(
                f"heartbeat_s must be in (0, lease_s), got {self.heartbeat_s} and {self.lease_s}"
            )
        if self.publish_interval_s <= 0 or self.redis_timeout_s <= 0:
            raise ValueError(
                f"publish_interval_s and redis_timeout_s must be > 0, got "
                f"{self.publish_interval_s} and {self.redis_timeout_s}"
            )


def to_index_events(sequencer: KvEventSequencer, events: Sequence[KVCacheEvent]) -> list[KvEvent]:
    """Number the engine's events for the index (pure)."""
    out: list[KvEvent] = []
    for event in events:
        if isinstance(event, BlocksStored):
            out.append(sequencer.stored(event.block_hashes, event.tier))
        elif isinstance(event, BlocksRemoved):
            out.append(sequencer.removed(event.block_hashes))
        elif isinstance(event, CacheCleared):
            out.append(sequencer.cleared())
        else:
            raise AssertionError(f"unknown KV cache event {event!r}")
    return out


class WorkerAgent:
    """Keeps one worker incarnation registered and its index entries current (a thread)."""

    def __init__(
        self,
        client: redis.Redis,
        info: WorkerInfo,
        stats_fn: StatsFn,
        drain_fn: DrainFn,
        snapshot_fn: SnapshotFn,
        config: AgentConfig | None = None,
        epoch: int | None = None,
    ) -> None:
        self.config = config or AgentConfig()
        keys = RedisKeys(self.config.key_prefix)
        self.info = info  # epoch and load are filled in at each registration
        self._client = client
        self._registry = WorkerRegistry(client, keys, self.config.lease_s)
        self._index = LocalityIndex(client, keys)
        self._stats_fn, self._drain_fn, self._snapshot_fn = stats_fn, drain_fn, snapshot_fn
        self.epoch = epoch if epoch is not None else self._registry.allocate_epoch()
        self._sequencer = KvEventSequencer(info.worker_id, self.epoch)
        self._load = WorkerLoad()
        self._snapshot_owed = True
        self._next_heartbeat_s = 0.0
        self._outage: str | None = None  # the error that started the current outage
        self._stop = threading.Event()
        self.superseded = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"agent-{info.worker_id}", daemon=True
        )

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def connected(self) -> bool:
        """False while Redis is unreachable."""
        return self._outage is None

    def start(self) -> WorkerAgent:
        """Register and publish the first snapshot now (raises if Redis is down), then loop."""
        self._load = self._current_load()
        self._register()
        self._publish_snapshot()
        self._next_heartbeat_s = time.monotonic() + self.config.heartbeat_s
        self._thread.start()
        log.info("worker %s registered (epoch %d)", self.worker_id, self.epoch)
        return self

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop heartbeating and, by default, remove the registration (the router stops
        routing here; running requests go on)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if deregister:
            try:
                self._registry.deregister(self.worker_id, self.epoch)
            except redis.RedisError as err:
                log.warning(
                    "deregister of %s failed (its lease will lapse): %r", self.worker_id, err
                )

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.config.publish_interval_s):
            try:
                self._tick()
            except redis.RedisError as err:
                self._lost_redis(err)
            except (TimeoutError, RuntimeError) as err:
                # The engine did not answer in time (a long step) or is stopping; a drain may
                # still run after we gave up on it, so only a snapshot is certain to be right.
                log.info("worker %s: engine callback failed: %r", self.worker_id, err)
                self._snapshot_owed = True
            except Exception:
                # The agent must outlive any one bad tick (a worker that stops heartbeating
                # vanishes from routing); say what broke and owe the index a snapshot.
                log.exception("worker %s: agent tick failed; retrying", self.worker_id)
                self._snapshot_owed = True
            if self.superseded.is_set():
                return

    def _tick(self) -> None:
        now = time.monotonic()
        if self._outage is not None or now >= self._next_heartbeat_s:
            self._next_heartbeat_s = now + self.config.heartbeat_s
            self._heartbeat()
        if self._snapshot_owed:
            self._publish_snapshot()
        else:
            self._publish_deltas()
        if self._outage is not None:
            log.warning("worker %s: Redis is back (after %s)", self.worker_id, self._outage)
            self._outage = None

    def _heartbeat(self) -> None:
        self._load = self._current_load()
        reply = self._registry.heartbeat(self.worker_id, self.epoch, self._load)
        if reply.status is HeartbeatStatus.SUPERSEDED:
            self._superseded()
        elif reply.status is HeartbeatStatus.LEASE_LOST:
            self._new_epoch()
            log.warning("worker %s lost its lease; registering again, epoch %d",
                        self.worker_id, self.epoch)  # fmt: skip
            self._register()
        elif reply.snapshot_wanted:
            self._snapshot_owed = True

    def _new_epoch(self) -> None:
        self.epoch = self._registry.allocate_epoch()
        self._sequencer = KvEventSequencer(self.worker_id, self.epoch)

    def _register(self) -> None:
        if not self._registry.register(replace(self.info, epoch=self.epoch, load=self._load)):
            self._superseded()
        self._snapshot_owed = True

    def _publish_snapshot(self) -> None:
        cached = self._snapshot_fn()
        event = self._sequencer.snapshot(cached.block_hashes, cached.tiers)
        self._snapshot_owed = False
        self._check(self._index.apply([event]).statuses, snapshot=True)

    def _publish_deltas(self) -> None:
        events = to_index_events(self._sequencer, self._drain_fn())
        if events:
            self._check(self._index.apply(events).statuses, snapshot=False)

    def _check(self, statuses: Sequence[ApplyStatus], snapshot: bool) -> None:
        owed = {ApplyStatus.GAP, ApplyStatus.AWAITING_SNAPSHOT, ApplyStatus.NOT_REGISTERED}
        if any(s in owed for s in statuses):
            # NOT_REGISTERED: lease lapsed; the next heartbeat (now) re-registers first.
            self._snapshot_owed = True
            self._next_heartbeat_s = 0.0
        if ApplyStatus.STALE_EPOCH in statuses:
            self._superseded()
        if snapshot and statuses and statuses[0] is not ApplyStatus.APPLIED:
            log.info("worker %s: snapshot not applied: %s", self.worker_id, statuses[0].name)

    def _current_load(self) -> WorkerLoad:
        try:
            return self._stats_fn()
        except TimeoutError:
            return self._load  # a long engine step: renew the lease with the last load

    def _lost_redis(self, err: redis.RedisError) -> None:
        if self._outage is None:
            self._outage = repr(err)
            log.warning("worker %s: Redis unreachable, will retry: %r", self.worker_id, err)
        self._snapshot_owed = True  # whatever was drained in this tick is lost
        self._discard_events()

    def _discard_events(self) -> None:
        # Keep the engine's event list short during an outage; the snapshot covers them.
        try:
            self._drain_fn()
        except (TimeoutError, RuntimeError) as err:
            log.debug("could not drain KV events of %s: %r", self.worker_id, err)

    def _superseded(self) -> None:
        log.error(
            "worker %s epoch %d was superseded by a newer incarnation; stopping its agent",
            self.worker_id,
            self.epoch,
        )
        self.superseded.set()
        self._stop.set()


def start_worker_agent(
    redis_url: str,
    info: WorkerInfo,
    stats_fn: StatsFn,
    drain_fn: DrainFn,
    snapshot_fn: SnapshotFn,
    config: AgentConfig | None = None,
    epoch: int | None = None,
) -> WorkerAgent:
    """Connect, allocate an epoch (unless given), register, publish a snapshot, and keep
    doing so in a background thread. Raises ``redis.ConnectionError`` if Redis is down."""
    config = config or AgentConfig()
    client = redis.Redis.from_url(
        redis_url,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
    )
    agent = WorkerAgent(client, info, stats_fn, drain_fn, snapshot_fn, config, epoch)
    return agent.start()
