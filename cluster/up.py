"""`pdserve up`: Redis, Ray, the worker pools and the router, started and stopped together.

::

    redis-server (embedded, supervised)  or  --redis-url
    Ray: local cluster (ray.init)        or  --ray-address
    pools: prefill / decode / colocated Ray actors -> load, warm up, register in Redis
    router (this process): gRPC + OpenAI HTTP (+ /metrics, /dashboard), workers from the
           Redis registry, prefix lookups in the Redis locality index, goodput to Redis
    supervise every second: Ray restarted workers, replace lost ones, follow target sizes
           (`pdserve scale`), restart the embedded redis-server if it died
    SIGINT / SIGTERM: router stops taking requests -> workers stop -> Ray -> Redis

By default a cluster secret secures the inside (cluster/secret.py): Redis password, Ray token,
mutual TLS to the workers, authenticated KV. Once serving, the endpoints are printed and
written as JSON to the state file (mode 0600: its Redis URL carries the password), which
`pdserve status` and `pdserve scale` read to find Redis.

With ``--head`` other hosts join (cluster/join.py): Redis, Ray and the router bind this
host's address (cluster/host_address.py), this host's Ray node is labelled with its name
and its own workers (none by default) are placed on it, the worker template goes to Redis,
and the command to run on the other hosts is printed, with the join token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import ray
import redis

from pdserve.cluster.actuators import POOLS
from pdserve.cluster.actuators.ray import PoolTargetActuator
from pdserve.cluster.autoscaler import AutoscaleSettings, RedisClusterView, build_autoscaler
from pdserve.cluster.host_address import is_wildcard, this_host_address
from pdserve.cluster.join_token import JoinToken, ray_auth_token
from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.pool_manager import PoolMember, PoolTargets
from pdserve.cluster.ray_cluster import RayEndpoints, gpus_available, start_or_join_ray
from pdserve.cluster.ray_pools import HOST_LABEL, ActorResources, RayWorkerPool
from pdserve.cluster.redis_server import RedisAuthError, connect, redacted_url
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.router_start import RedisRouterSpec, router_process, start_redis_router
from pdserve.cluster.router_wiring import RedisWorkerDirectory
from pdserve.cluster.secret import SecretSource, cluster_secret, ray_token_auth
from pdserve.cluster.supervise import Supervised, SupervisedRedis, embedded_redis, supervise
from pdserve.cluster.worker_agent import AgentConfig
from pdserve.cluster.worker_launch import WorkerLaunch
from pdserve.cluster.worker_template import publish_template
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo
from pdserve.router.config import RouterConfig
from pdserve.router.edge.tokenizer import RouterTokenizer, load_router_tokenizer
from pdserve.router.event_loop import run as run_loop
from pdserve.router.processes import RouterProcesses, spawn_routers
from pdserve.router.service import RouterService
from pdserve.worker.cluster_secret import ClusterSecret, write_private_text

log = logging.getLogger("pdserve.up")
ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True, frozen=True)
class HeadSettings:
    """`pdserve up --head`: a cluster other hosts join."""

    name: str  # this host's name: its Ray node label
    join_token_file: Path  # written once serving; copied to the hosts that join
    advertise_address: str | None = None  # None: chosen by cluster/host_address.py


@dataclass(slots=True, frozen=True)
class UpConfig:
    """Everything `pdserve up` was asked for (built by cluster/cli_up.py)."""

    targets: PoolTargets
    worker: WorkerLaunch  # template: role, worker id and Redis URL are filled in per worker
    resources: ActorResources
    num_gpus_per_worker: float
    router: RouterConfig
    ray_address: str | None = None
    redis_url: str | None = field(default=None, repr=False)  # may carry a password
    include_dashboard: bool | None = None
    state_file: Path | None = None
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    supervise_s: float = 1.0
    router_processes: int = 1  # >1: that many router processes share the ports
    autoscale: AutoscaleSettings | None = None  # None: the pools keep their targets
    secret: SecretSource | None = None  # None: no cluster authentication
    head: HeadSettings | None = None  # None: a one-host cluster (or one joining --ray-address)


@dataclass(slots=True, frozen=True)
class Endpoints:
    http: str
    grpc: str
    metrics: str
    dashboard: str
    ray_dashboard: str | None
    redis_url: str
    ray_address: str
    key_prefix: str
    workers: dict[str, int]
    pid: int
    router_pids: list[int]
    secret_file: str | None  # the cluster secret (None: no cluster authentication)
    join_command: str | None = None  # with --head: what to run on the other hosts

    def describe(self) -> str:
        pools = " + ".join(f"{n} {role}" for role, n in self.workers.items() if n)
        lines = [
            f"pdserve is up: {pools} worker(s)" if pools else "pdserve is up: no workers here",
            f"  OpenAI HTTP    {self.http}/v1",
            f"  gRPC           {self.grpc}",
            f"  router pids    {', '.join(map(str, self.router_pids))}",
            f"  metrics        {self.metrics}",
            f"  dashboard      {self.dashboard}",
            f"  Ray dashboard  {self.ray_dashboard or '(off)'}",
            f"  Redis          {redacted_url(self.redis_url)}",
            f"  secret         {self.secret_file or '(off: no cluster authentication)'}",
        ]
        if self.join_command:
            lines += [
                "On each other host, with a copy of the join token file (it holds the "
                "cluster's credentials) and its own pool sizes:",
                f"  {self.join_command}",
            ]
        lines.append("Ctrl-C to stop.")
        return "\n".join(lines)


def run_up(config: UpConfig) -> int:
    """Start everything, serve until SIGINT/SIGTERM, stop everything. Returns 0."""
    interrupt_on_sigterm()
    try:
        with contextlib.ExitStack() as stack:
            secret = stack.enter_context(cluster_secret(config.secret))
            password = secret.redis_password() if secret is not None else None
            address = (
                None if config.head is None else this_host_address(config.head.advertise_address)
            )
            embedded = None
            if not config.redis_url:
                embedded = stack.enter_context(embedded_redis(password, address or "127.0.0.1"))
            redis_url = config.redis_url or (embedded.url if embedded else "")
            stack.callback(_report_registered, redis_url, config.worker.agent)
            if secret is not None and config.secret is not None and config.ray_address is None:
                stack.enter_context(ray_token_auth(secret, config.secret))
            ray_endpoints = _start_ray(config, address)
            stack.callback(_stop_ray, ray_endpoints)
            interrupt_on_sigterm()  # ray.init installed its own SIGTERM handler
            pools = _start_pools(config, redis_url, secret)
            stack.callback(_stop_pools, pools)
            # The router's tokenizer loads while the workers load their models.
            loader = stack.enter_context(ThreadPoolExecutor(1, "tokenizer"))
            tokenizer = loader.submit(load_router_tokenizer, config.worker.worker.model)
            for pool in pools.values():
                pool.wait_ready(config.ready_timeout_s)
            served = _serve(
                config, pools, redis_url, embedded, ray_endpoints, tokenizer, secret, address
            )
            run_loop(served)  # uvloop when installed (router/event_loop.py)
    except KeyboardInterrupt:
        log.warning("interrupted during start-up; everything stopped")
    return 0


def _report_registered(redis_url: str, agent: AgentConfig) -> None:
    """The last look at Redis before it stops: every worker has stopped, so each should
    have deregistered."""
    try:
        client = connect(redis_url, timeout_s=2.0)
        try:
            registry = WorkerRegistry(client, RedisKeys(agent.key_prefix), agent.lease_s)
            left = [w.worker_id for w in registry.list_workers()]
        finally:
            client.close()
    except (redis.RedisError, OSError, RedisAuthError) as err:
        log.warning("worker registry unreadable at exit: %r", err)
        return
    if left:
        log.warning("at exit %d workers are still registered (leases lapse): %s", len(left), left)
    else:
        log.info("at exit every worker has deregistered")


def interrupt_on_sigterm() -> None:
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def _start_ray(config: UpConfig, address: str | None) -> RayEndpoints:
    workers = sum(config.targets.of(role) for role in ROLES)
    if config.autoscale is not None:  # room for the largest pools the planner may ask for
        limits = (config.autoscale.planner.prefill, config.autoscale.planner.decode)
        workers = max(workers, sum(limit.max_replicas for limit in limits))
    cpus = max(float(os.cpu_count() or 1), workers * config.resources.num_cpus)
    labels = None if config.head is None else {HOST_LABEL: config.head.name}
    return start_or_join_ray(
        config.ray_address, cpus, config.include_dashboard, node_ip_address=address, labels=labels
    )


def _stop_ray(endpoints: RayEndpoints) -> None:
    ray.shutdown()  # a local cluster we started stops with it
    log.info("Ray %s", "stopped" if endpoints.started_here else "disconnected")


def _start_pools(
    config: UpConfig, redis_url: str, secret: ClusterSecret | None
) -> dict[str, RayWorkerPool]:
    resources = config.resources
    if gpus_available() and config.num_gpus_per_worker > 0:
        resources = replace(resources, num_gpus=config.num_gpus_per_worker)
    worker = replace(config.worker.worker, cluster_secret=secret)
    template = replace(config.worker, worker=worker, redis_url=redis_url)
    host = None if config.head is None else config.head.name
    pools = {role: RayWorkerPool(role, template, resources, host) for role in ROLES}
    for role, pool in pools.items():
        pool.scale_to(config.targets.of(role))
    return pools


def _stop_pools(pools: dict[str, RayWorkerPool]) -> None:
    for pool in pools.values():
        pool.shutdown()
    log.info("workers stopped")


async def _serve(
    config: UpConfig,
    pools: dict[str, RayWorkerPool],
    redis_url: str,
    embedded: SupervisedRedis | None,
    ray_endpoints: RayEndpoints,
    tokenizer: Future[RouterTokenizer],
    secret: ClusterSecret | None,
    address: str | None,
) -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    agent = config.worker.agent
    model = config.worker.worker.model
    spec = RedisRouterSpec(redis_url, agent.key_prefix, agent.lease_s, model, secret)
    client = spec.client()
    store = PoolTargetStore(client, RedisKeys(agent.key_prefix))
    store.write(config.targets)
    if config.head is not None:
        _open_to_other_hosts(config, client, redis_url, secret)
    directory, locality = spec.sources(client)
    keys = RedisKeys(agent.key_prefix)
    index = LocalityIndex(client, keys)
    autoscaler = None
    if config.autoscale is not None:
        view = RedisClusterView(
            client,
            agent.key_prefix,
            WorkerRegistry(client, keys, agent.lease_s),
            index,
            partial(_members, pools),
            config.autoscale.window,
        )
        actuator = PoolTargetActuator(store, config.targets)
        autoscaler = build_autoscaler(config.autoscale, actuator, view)
    router_config = replace(config.router, reuse_port=config.router_processes > 1)
    service = await start_redis_router(
        spec, router_config, await asyncio.wrap_future(tokenizer), directory, locality
    )
    routers = RouterProcesses(service, [])
    try:
        # Extra router processes share the ports; each builds its own router from Redis.
        extra = config.router_processes - 1
        await spawn_routers(routers, router_config, partial(router_process, spec), extra)
        await _wait_registered(directory, config.targets, config.ready_timeout_s)
        endpoints = _endpoints(config, service, redis_url, ray_endpoints, routers.pids, address)
        _announce(endpoints, config.state_file)
        parts = Supervised(pools, store, directory, index.unique_blocks, embedded, autoscaler)
        await supervise(stop, config.supervise_s, config.drain_timeout_s, config.targets, parts)
    finally:
        await routers.stop(grace_s=5.0)
        directory.stop()
        client.close()
        if config.state_file is not None:
            config.state_file.unlink(missing_ok=True)
        if config.head is not None:
            config.head.join_token_file.unlink(missing_ok=True)


def _open_to_other_hosts(
    config: UpConfig, client: Any, redis_url: str, secret: ClusterSecret | None
) -> None:
    """What `pdserve join` reads: the worker template in Redis, and the join token in a file
    of its own (mode 0600: it carries the cluster secret, or Ray's token without one)."""
    assert config.head is not None, "only a head opens to other hosts"
    key_prefix = config.worker.agent.key_prefix
    publish_template(client, RedisKeys(key_prefix), config.worker)
    if secret is not None:
        token = JoinToken(redis_url, key_prefix, secret=secret.to_text())
    else:
        token = JoinToken(redis_url, key_prefix, ray_auth_token=ray_auth_token())
    write_private_text(config.head.join_token_file, token.encode())


def _members(
    pools: dict[str, RayWorkerPool], workers: Sequence[WorkerInfo]
) -> dict[str, list[PoolMember]]:
    return {role: pools[role].members() for role in POOLS}  # their load comes with ``workers``


async def _wait_registered(
    directory: RedisWorkerDirectory, targets: PoolTargets, timeout_s: float
) -> None:
    """The pools are ready; wait until the router's directory lists all of them too."""
    wanted = sum(targets.of(role) for role in ROLES)
    for _ in range(max(1, math.ceil(timeout_s / 0.1))):
        if len(directory.live_workers()) >= wanted:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"only {len(directory.live_workers())} of {wanted} workers registered")


def _endpoints(
    config: UpConfig,
    service: RouterService,
    redis_url: str,
    ray_endpoints: RayEndpoints,
    router_pids: list[int],
    address: str | None,
) -> Endpoints:
    host = config.router.host
    if is_wildcard(host):
        host = address or "127.0.0.1"
    scheme = "https" if config.router.tls_cert_path else "http"
    http = f"{scheme}://{host}:{service.http_port}"
    return Endpoints(
        http=http,
        grpc=f"{host}:{service.grpc_port}",
        metrics=f"{http}/metrics",
        dashboard=f"{http}/dashboard",
        ray_dashboard=ray_endpoints.dashboard_url,
        redis_url=redis_url,
        ray_address=ray_endpoints.address,
        key_prefix=config.worker.agent.key_prefix,
        workers={role: config.targets.of(role) for role in ROLES},
        pid=os.getpid(),
        router_pids=router_pids,
        secret_file=str(config.secret.path) if config.secret is not None else None,
        join_command=None if config.head is None else _join_command(config.head, ray_endpoints),
    )


def _join_command(head: HeadSettings, ray_endpoints: RayEndpoints) -> str:
    return (
        f"pdserve join {ray_endpoints.address} --token-file {head.join_token_file} "
        "--prefill N --decode M [--name HOST] [--router]"
    )


def _announce(endpoints: Endpoints, state_file: Path | None) -> None:
    print(endpoints.describe(), flush=True)
    if state_file is not None:  # its Redis URL may carry the password: owner-only
        write_private_text(state_file, json.dumps(dataclasses.asdict(endpoints), indent=2))
