"""How `pdserve up` builds a router over Redis: in its own process, and in each extra
router process (``--router-processes``, router/processes.py).

Every router process builds the same things for itself: a Redis client, the worker
directory (a thread listing the registry), the locality index and the tokenizer. The
description it builds them from, ``RedisRouterSpec``, is picklable, so that
``functools.partial(router_process, spec)`` is a factory a spawned child can run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial

import redis

from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.router_wiring import RedisLocality, RedisWorkerDirectory
from pdserve.proto.redis_keys import RedisKeys
from pdserve.router.config import RouterConfig
from pdserve.router.edge.tokenizer import RouterTokenizer, load_router_tokenizer
from pdserve.router.processes import RouterProcesses, spawn_routers
from pdserve.router.service import RouterService, start_router
from pdserve.router.state.batched_lookups import BatchedLookups
from pdserve.router.state.locality import engine_prompt_hasher
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.mutual_tls import client_tls


@dataclass(frozen=True, slots=True)
class RedisRouterSpec:
    """Where a router finds its workers, what it serves, and the cluster secret its worker
    channels present (None: plaintext)."""

    redis_url: str = field(repr=False)  # may carry the Redis password
    key_prefix: str
    lease_s: float
    model: str
    cluster_secret: ClusterSecret | None = field(default=None, repr=False)

    def client(self) -> redis.Redis:
        # Short timeouts: a request must not wait long on a Redis that went away.
        return redis.Redis.from_url(self.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def sources(self, client: redis.Redis) -> tuple[RedisWorkerDirectory, RedisLocality]:
        """The started worker directory and the locality index, over ``client``."""
        from pdserve.cluster.locality_index import LocalityIndex

        keys = RedisKeys(self.key_prefix)
        index = LocalityIndex(client, keys)
        directory = RedisWorkerDirectory(WorkerRegistry(client, keys, self.lease_s), index)
        return directory.start(), RedisLocality(index)


async def start_redis_router(
    spec: RedisRouterSpec,
    config: RouterConfig,
    tokenizer: RouterTokenizer,
    directory: RedisWorkerDirectory,
    locality: RedisLocality,
) -> RouterService:
    """A router over the Redis registry and locality index; its goodput figures go to the
    same Redis, under the same key prefix."""
    hasher = engine_prompt_hasher(tokenizer.model_id, config.block_size)
    slo = replace(config.slo, redis_url=spec.redis_url, redis_prefix=spec.key_prefix)
    lookups = BatchedLookups(locality)  # off the event loop, batched under load
    secret = spec.cluster_secret
    worker_tls = client_tls(secret) if secret is not None else None
    return await start_router(
        replace(config, slo=slo), tokenizer, directory, lookups, hasher, worker_tls=worker_tls
    )


async def router_process(spec: RedisRouterSpec, config: RouterConfig) -> RouterService:
    """The factory of an extra router process. Its directory thread and Redis client live
    as long as the process, which ends when its router stops."""
    tokenizer = await asyncio.to_thread(load_router_tokenizer, spec.model)
    directory, locality = spec.sources(spec.client())
    return await start_redis_router(spec, config, tokenizer, directory, locality)


@contextlib.asynccontextmanager
async def redis_routers(
    spec: RedisRouterSpec, config: RouterConfig, processes: int = 1
) -> AsyncIterator[RouterProcesses]:
    """``processes`` routers over Redis sharing ``config``'s ports (`pdserve router`, and
    the router `pdserve join --router` runs on a worker host), stopped on exit."""
    tokenizer = await asyncio.to_thread(load_router_tokenizer, spec.model)
    directory, locality = spec.sources(spec.client())
    service = await start_redis_router(spec, config, tokenizer, directory, locality)
    routers = RouterProcesses(service, [])
    try:
        await spawn_routers(routers, config, partial(router_process, spec), processes - 1)
        yield routers
    finally:
        await routers.stop(grace_s=5.0)
        directory.stop()
