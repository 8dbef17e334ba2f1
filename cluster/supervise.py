"""What `pdserve up` does while serving: keep the embedded Redis up, follow Ray's restarts
of workers, replace lost ones, let the autoscaler (``--autoscale``) set the targets, and
resize pools to the targets stored in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import redis

from pdserve.cluster.autoscaler import Autoscaler
from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.pool_manager import MemberState, PoolTargets
from pdserve.cluster.ray_pools import RayWorkerPool
from pdserve.cluster.redis_server import RedisServer, RedisServerConfig
from pdserve.cluster.router_wiring import RedisWorkerDirectory

log = logging.getLogger("pdserve.up")


class SupervisedRedis:
    """The embedded redis-server; restarted on the same port (and password) if it dies."""

    def __init__(self, password: str | None = None, host: str = "127.0.0.1") -> None:
        # a head binds its host's address: other hosts' workers use it
        self._config = RedisServerConfig(host=host, password=password)
        self.server = RedisServer(self._config).start()
        self.url = self.server.url

    def ensure_running(self) -> None:
        # Runs on the main thread: the child's PDEATHSIG is tied to the thread that forks.
        if not self.server.is_running:
            log.warning("embedded redis-server died; restarting it on port %d", self.server.port)
            self.server.stop()
            self.server = RedisServer(replace(self._config, port=self.server.port)).start()

    def stop(self) -> None:
        self.server.stop()
        log.info("embedded redis-server stopped")


@contextlib.contextmanager
def embedded_redis(
    password: str | None = None, host: str = "127.0.0.1"
) -> Iterator[SupervisedRedis]:
    """A supervised redis-server on ``host``; with ``password`` it requires it."""
    redis_sup = SupervisedRedis(password, host)
    try:
        yield redis_sup
    finally:
        redis_sup.stop()


UniqueBlocksFn = Callable[[Sequence[str]], dict[str, int]]


@dataclass(slots=True)
class Supervised:
    """What the supervising loop looks after."""

    pools: dict[str, RayWorkerPool]
    store: PoolTargetStore
    directory: RedisWorkerDirectory
    unique_blocks: UniqueBlocksFn  # the locality index's, to pick whom to drain
    embedded: SupervisedRedis | None = None
    autoscaler: Autoscaler | None = None


async def supervise(
    stop: asyncio.Event,
    period_s: float,
    drain_timeout_s: float,
    targets: PoolTargets,
    parts: Supervised,
) -> None:
    """Until ``stop``: keep Redis up, collect Ray restarts, autoscale, follow the targets."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
        if stop.is_set():
            return
        if parts.embedded is not None:
            parts.embedded.ensure_running()
        if parts.autoscaler is not None:
            await asyncio.to_thread(_autoscale, parts.autoscaler)
        targets = parts.store.read(targets)
        running = {w.worker_id: w.load.running for w in parts.directory.live_workers()}
        for role, pool in parts.pools.items():
            await asyncio.to_thread(
                _reconcile, pool, targets.of(role), drain_timeout_s, running, parts.unique_blocks
            )


def _autoscale(autoscaler: Autoscaler) -> None:
    try:
        autoscaler.tick(time.monotonic())
    except (redis.RedisError, OSError) as err:  # Redis away: keep the pools as they are
        log.warning("autoscaler skipped a decision: %r", err)


def _reconcile(
    pool: RayWorkerPool,
    target: int,
    drain_timeout_s: float,
    running: dict[str, int],
    unique_blocks: UniqueBlocksFn,
) -> None:
    pool.poll()
    active = [
        m.worker_id for m in pool.members() if m.state in (MemberState.STARTING, MemberState.READY)
    ]
    unique: dict[str, int] = {}
    if len(active) > target:
        try:
            unique = unique_blocks(active)
        except (redis.RedisError, OSError) as err:  # drain by load alone
            log.warning("locality index unreadable, draining by load alone: %r", err)
    decision = pool.scale_to(target, drain_timeout_s, running, unique)
    if not decision.is_noop:
        log.info("%s pool -> %d: start %s, drain %s", pool.role, target, decision.start,
                 decision.drain)  # fmt: skip
