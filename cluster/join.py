"""`pdserve join`: another host in the cluster that `pdserve up --head` leads.

::

    pdserve join HEAD:PORT --token TOKEN --prefill N --decode M [--router]
      this host's address: the one its route to the head leaves from (cluster/host_address.py)
      Ray node: `ray start --address HEAD:PORT --block` (cluster/ray_node.py), labelled
             pdserve.host=NAME; this process joins as a driver on that node
      workers: the head's worker template from Redis (cluster/worker_template.py); one pool
             per role, placed on this node, ids <role>-<NAME>-<slot>; they register in the
             cluster's Redis, and every router routes to them
      router (--router): one more front door over the same Redis, on this host
      every second: Ray's restarts collected, lost workers replaced. The Ray node gone (the
             head declared this host dead while it was cut off): join again; the new workers
             register with new epochs
    SIGINT / SIGTERM / `pdserve leave`: router stops -> workers drain (deregister, finish
      their requests) -> the driver disconnects -> the Ray node stops (the host leaves Ray)
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
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import ray

from pdserve.cluster.host_address import is_wildcard, this_host_address
from pdserve.cluster.join_token import JoinToken
from pdserve.cluster.ray_cluster import start_or_join_ray
from pdserve.cluster.ray_node import RayNode, RayNodeSpec
from pdserve.cluster.ray_pools import ActorResources, RayWorkerPool
from pdserve.cluster.redis_server import connect
from pdserve.cluster.router_start import RedisRouterSpec, redis_routers
from pdserve.cluster.up import interrupt_on_sigterm
from pdserve.cluster.worker_launch import WorkerLaunch
from pdserve.cluster.worker_template import read_template
from pdserve.proto.redis_keys import RedisKeys
from pdserve.router.config import RouterConfig
from pdserve.router.event_loop import run as run_loop
from pdserve.worker import server as ws
from pdserve.worker.cluster_secret import ClusterSecret

log = logging.getLogger("pdserve.join")


@dataclass(slots=True, frozen=True)
class JoinConfig:
    """Everything `pdserve join` was asked for (built by cluster/cli_join.py)."""

    head_address: str  # the head's Ray address, host:port
    token: JoinToken
    name: str  # this host's name: its Ray node label and part of its workers' ids
    workers: Mapping[str, int]  # role -> how many run on this host
    resources: ActorResources
    state_file: Path
    advertise_address: str | None = None  # None: toward the head
    worker_args: tuple[str, ...] = ()  # this host's own worker server flags (--num-blocks)
    router: RouterConfig | None = None  # a router on this host too (its block size: the head's)
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    supervise_s: float = 1.0


@dataclass(slots=True, frozen=True)
class JoinedHost:
    """What the state file says of a joined host (`pdserve leave` reads its pid)."""

    pid: int
    name: str
    address: str
    head: str
    workers: list[str]
    http: str | None = None  # the router on this host, if any
    grpc: str | None = None


def run_join(config: JoinConfig) -> int:
    """Join, serve until SIGINT/SIGTERM, then drain and leave. Returns 0. Ray reads its
    authentication variables when it is imported: the caller sets ``ray_auth_env`` first
    (the Ray node inherits them)."""
    interrupt_on_sigterm()
    address = this_host_address(config.advertise_address, toward=config.head_address)
    try:
        while _join_once(config, address):
            log.warning("host %s: its Ray node left the cluster; joining again", config.name)
            time.sleep(1.0)
    except KeyboardInterrupt:
        log.warning("interrupted during start-up; left the cluster")
    finally:
        ray_token_file(config.state_file).unlink(missing_ok=True)
    return 0


def ray_token_file(state_file: Path) -> Path:
    """Where this host keeps the Ray token it derives from the cluster secret (mode 0600)."""
    return state_file.with_suffix(".ray-token")


def _join_once(config: JoinConfig, address: str) -> bool:
    """One membership of the cluster: True when the Ray node was lost (join again)."""
    with contextlib.ExitStack() as stack:
        node = RayNode(_node_spec(config, address)).start()
        stack.callback(node.stop)
        start_or_join_ray(config.head_address, node_ip_address=address)
        stack.callback(ray.shutdown)
        interrupt_on_sigterm()  # ray.init installed its own SIGTERM handler
        launch = _launch(config)
        pools = {
            role: RayWorkerPool(
                role, launch, config.resources, config.name, f"{role}-{config.name}"
            )
            for role, count in config.workers.items()
            if count > 0
        }
        stack.callback(_leave, pools, node, config.drain_timeout_s)
        for role, pool in pools.items():
            pool.scale_to(config.workers[role])
        for pool in pools.values():
            pool.wait_ready(config.ready_timeout_s)
        return run_loop(_serve(config, pools, node, address, launch))


def _node_spec(config: JoinConfig, address: str) -> RayNodeSpec:
    wanted = sum(config.workers.values()) * config.resources.num_cpus
    return RayNodeSpec(
        head_address=config.head_address,
        node_ip_address=address,
        host_name=config.name,
        num_cpus=max(os.cpu_count() or 1, math.ceil(wanted)),
        log_path=config.state_file.with_suffix(".ray.log"),
    )


def _launch(config: JoinConfig) -> WorkerLaunch:
    """The head's worker template, bound to this host's address (Ray's node IP)."""
    client = connect(config.token.redis_url)
    try:
        launch = read_template(
            client, RedisKeys(config.token.key_prefix), config.token.redis_url, "auto"
        )
    finally:
        client.close()
    extra_args = (*launch.worker.extra_args, *config.worker_args)
    worker = replace(launch.worker, extra_args=extra_args, cluster_secret=_secret(config))
    return replace(launch, worker=worker)


def _secret(config: JoinConfig) -> ClusterSecret | None:
    text = config.token.secret
    return None if text is None else ClusterSecret.from_text(text)


async def _serve(
    config: JoinConfig,
    pools: dict[str, RayWorkerPool],
    node: RayNode,
    address: str,
    launch: WorkerLaunch,
) -> bool:
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        host = JoinedHost(
            os.getpid(), config.name, address, config.head_address,
            [w.worker_id for pool in pools.values() for w in pool.hosted()],
        )  # fmt: skip
        if config.router is not None:
            spec = RedisRouterSpec(config.token.redis_url, config.token.key_prefix,
                                   launch.agent.lease_s, launch.worker.model,
                                   launch.worker.cluster_secret)  # fmt: skip
            router = replace(config.router, block_size=_block_size(launch))
            routers = await stack.enter_async_context(redis_routers(spec, router))
            bound = config.router.host
            shown = address if is_wildcard(bound) else bound
            service = routers.service
            host = replace(host, http=f"http://{shown}:{service.http_port}",
                           grpc=f"{shown}:{service.grpc_port}")  # fmt: skip
        _announce(host, config.state_file)
        stack.callback(config.state_file.unlink, missing_ok=True)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), config.supervise_s)
            if not node.alive:
                return True
            for role, pool in pools.items():
                await asyncio.to_thread(_keep, pool, config.workers[role])
    return False


def _block_size(launch: WorkerLaunch) -> int:
    """The workers' block size, which the router hashes prompts with: their server's flags
    read by their server's own parser."""
    block_size: int = ws.build_parser().parse_args(launch.worker.server_args()).block_size
    return block_size


def _keep(pool: RayWorkerPool, target: int) -> None:
    """Collect Ray's restarts; replace workers Ray gave up on."""
    pool.poll()
    pool.scale_to(target)


def _leave(pools: dict[str, RayWorkerPool], node: RayNode, drain_timeout_s: float) -> None:
    """Drain this host's workers (the routers stop sending them requests at once; running
    ones finish), then stop them. A lost node has nothing left to drain."""
    for pool in pools.values():
        if node.alive:
            pool.scale_to(0, drain_timeout_s)
        pool.shutdown()
    log.info("host's workers stopped")


def _announce(host: JoinedHost, state_file: Path) -> None:
    lines = [f"host {host.name} ({host.address}) joined the cluster at {host.head}",
             f"  workers  {', '.join(host.workers) or '(none)'}"]  # fmt: skip
    if host.http is not None:
        lines += [f"  OpenAI HTTP  {host.http}/v1", f"  gRPC         {host.grpc}"]
    lines.append("`pdserve leave` (or Ctrl-C) drains them and leaves.")
    print("\n".join(lines), flush=True)
    state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_file.with_suffix(state_file.suffix + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(host), indent=2))
    tmp.replace(state_file)


def leave(state_file: Path, timeout_s: float) -> JoinedHost:
    """Stop the `pdserve join` that wrote ``state_file`` (SIGTERM: it drains and leaves) and
    wait until it has; TimeoutError after ``timeout_s``."""
    if not state_file.is_file():
        raise ValueError(f"no joined host recorded at {state_file}: is `pdserve join` running "
                         "here? Pass --state-file")  # fmt: skip
    host = JoinedHost(**json.loads(state_file.read_text()))
    try:
        os.kill(host.pid, signal.SIGTERM)
    except ProcessLookupError:
        state_file.unlink(missing_ok=True)
        raise ValueError(f"pdserve join (pid {host.pid}) is not running; removed its stale "
                         f"state file {state_file}") from None  # fmt: skip
    deadline_s = time.monotonic() + timeout_s
    while _running(host.pid):
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"pdserve join (pid {host.pid}) still draining after {timeout_s} s")
        time.sleep(0.2)
    return host


def _running(pid: int) -> bool:
    """``pid`` has not exited (a zombie has: only its parent has yet to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
