"""What `pdserve up` does while serving: keep the embedded Redis up, follow Ray's restarts
of workers, replace lost ones and resize pools to the targets stored in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.pool_manager import PoolTargets
from pdserve.cluster.ray_pools import RayWorkerPool
from pdserve.cluster.redis_server import RedisServer, RedisServerConfig
from pdserve.cluster.router_wiring import RedisWorkerDirectory

log = logging.getLogger("pdserve.up")


class SupervisedRedis:
    """The embedded redis-server; restarted on the same port if it dies."""

    def __init__(self) -> None:
        self.server = RedisServer(RedisServerConfig()).start()
        self.url = self.server.url

    def ensure_running(self) -> None:
        # Runs on the main thread: the child's PDEATHSIG is tied to the thread that forks.
        if not self.server.is_running:
            log.warning("embedded redis-server died; restarting it on port %d", self.server.port)
            self.server.stop()
            self.server = RedisServer(RedisServerConfig(port=self.server.port)).start()

    def stop(self) -> None:
        self.server.stop()


@contextlib.contextmanager
def embedded_redis() -> Iterator[SupervisedRedis]:
    redis_sup = SupervisedRedis()
    try:
        yield redis_sup
    finally:
        redis_sup.stop()


async def supervise(
    stop: asyncio.Event,
    period_s: float,
    drain_timeout_s: float,
    targets: PoolTargets,
    pools: dict[str, RayWorkerPool],
    store: PoolTargetStore,
    embedded: SupervisedRedis | None,
    directory: RedisWorkerDirectory,
) -> None:
    """Until ``stop``: keep Redis up, collect Ray restarts, follow the target sizes."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
        if stop.is_set():
            return
        if embedded is not None:
            embedded.ensure_running()
        targets = store.read(targets)
        running = {w.worker_id: w.load.running for w in directory.live_workers()}
        for role, pool in pools.items():
            await asyncio.to_thread(_reconcile, pool, targets.of(role), drain_timeout_s, running)


def _reconcile(
    pool: RayWorkerPool, target: int, drain_timeout_s: float, running: dict[str, int]
) -> None:
    pool.poll()
    decision = pool.scale_to(target, drain_timeout_s, running)
    if not decision.is_noop:
        log.info("%s pool -> %d: start %s, drain %s", pool.role, target, decision.start,
                 decision.drain)  # fmt: skip
