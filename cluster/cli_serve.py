"""`pdserve router` and `pdserve worker`: one router, or one worker, as a process of its own
over the cluster's Redis (what a Kubernetes pod runs; `pdserve up` runs both under Ray).

Give both the cluster secret (``--cluster-secret-file`` or ``PDSERVE_CLUSTER_SECRET_FILE``)
to secure the inside as `pdserve up` does: workers then serve mutual TLS and authenticated KV,
routers call them with the secret's certificate (the Redis URL brings its own password).

A worker registers in Redis once it serves (its KV events feed the locality index) and, on
SIGTERM, deregisters, lets its running requests finish (up to ``--grace-s``) and stops. The
router finds the workers in the same Redis and serves OpenAI HTTP and gRPC until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cluster.front_door import add_front_door_arguments, front_door_fields
from pdserve.cluster.routing_options import add_routing_arguments, routing_fields
from pdserve.cluster.settings import Settings
from pdserve.cluster.slo_options import add_slo_arguments, slo_fields
from pdserve.engine.device_options import add_device_arguments, device_flags, device_settings
from pdserve.engine.kv_cache.tier_options import (
    add_kv_cache_dtype_argument,
    add_kv_tier_arguments,
    kv_tier_flags,
    kv_tier_settings,
)
from pdserve.engine.speculative.options import add_speculative_arguments, speculative_flags

if TYPE_CHECKING:
    from pdserve.worker.cluster_secret import ClusterSecret

log = logging.getLogger("pdserve.serve")


def _add_redis_arguments(p: argparse.ArgumentParser, settings: Settings) -> None:
    p.add_argument("--redis-url", default=settings.redis_url,
                   help="the cluster's Redis (default: PDSERVE_REDIS_URL)")  # fmt: skip
    p.add_argument("--key-prefix", default=settings.key_prefix)
    p.add_argument("--log-level", default=settings.log_level)
    p.add_argument("--cluster-secret-file", type=Path, default=settings.cluster_secret_file,
                   metavar="PATH", help="the cluster secret (mode 0600; default: "
                   "PDSERVE_CLUSTER_SECRET_FILE, else none: plaintext inside)")  # fmt: skip


def add_parsers(sub: Any) -> None:
    settings = Settings.from_env()
    r = sub.add_parser("router", help="one router over the cluster's Redis",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = r.add_argument
    add("--host", default="0.0.0.0", help="address to bind")
    add("--http-port", type=int, default=8000)
    add("--grpc-port", type=int, default=50051)
    add("--model", default="smollm2-135m-instruct", help="the model the workers serve")
    add("--block-size", type=int, default=16)
    add_routing_arguments(r, "default routing policy")
    add("--router-processes", type=int, default=1, metavar="N")
    _add_redis_arguments(r, settings)
    add_front_door_arguments(r, settings)
    add_slo_arguments(r)
    r.set_defaults(run=run_router)
    w = sub.add_parser("worker", help="one worker that registers in the cluster's Redis",
                       description=__doc__ + "\nOther flags go to the worker server "
                       "(python -m pdserve.worker.server -h).",
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = w.add_argument
    add("--role", required=True, choices=["prefill", "decode", "colocated"])
    add("--worker-id", default=None, help="default: ROLE-HOSTNAME")
    add("--host", default="127.0.0.1",
        help="address to bind and advertise; 'auto': the one other hosts reach this one at "
        "(cluster/host_address.py)")  # fmt: skip
    add("--port", type=int, default=0, help="gRPC port (0: a free one)")
    add("--model", default="smollm2-135m-instruct")
    add("--dtype", default="float32", choices=["float32", "bfloat16"])
    add("--kv-backend", default="nixl", choices=["nixl", "tcp"])
    add_device_arguments(w)
    add_kv_cache_dtype_argument(w)
    add("--grace-s", type=float, default=30.0, help="how long a drain may take on SIGTERM")
    add("--torch-threads", type=int, default=settings.torch_threads)
    _add_redis_arguments(w, settings)
    add_kv_tier_arguments(w)
    add_speculative_arguments(w)
    w.set_defaults(run=run_worker, passthrough=True)


def _configure(args: argparse.Namespace) -> str:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.redis_url:
        raise ValueError("--redis-url (or PDSERVE_REDIS_URL) is required")
    return str(args.redis_url)


def _cluster_secret(args: argparse.Namespace) -> ClusterSecret | None:
    from pdserve.worker.cluster_secret import read_secret_file

    if args.cluster_secret_file is None:
        return None
    return read_secret_file(args.cluster_secret_file)


def run_worker(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then drain and stop; 0 once stopped cleanly."""
    from pdserve.cluster.host_address import this_host_address
    from pdserve.cluster.worker_agent import AgentConfig
    from pdserve.cluster.worker_launch import WorkerLaunch
    from pdserve.worker.host import WorkerHost, WorkerSpec
    from pdserve.worker.server import role_speculation

    speculation = speculative_flags(role_speculation(args.role, args))
    tiers = kv_tier_flags(kv_tier_settings(args))
    engine_flags = ["--kv-cache-dtype", args.kv_cache_dtype, *device_flags(device_settings(args))]
    redis_url = _configure(args)
    settings = Settings.from_env()
    spec = WorkerSpec(
        role=args.role,
        worker_id=args.worker_id or f"{args.role}-{socket.gethostname()}",
        host=this_host_address() if args.host == "auto" else args.host,
        port=args.port,
        model=args.model,
        dtype=args.dtype,
        kv_backend=args.kv_backend,
        extra_args=(*engine_flags, *speculation, *tiers, *args.extra),
        torch_threads=args.torch_threads,
        grace_s=args.grace_s,
        cluster_secret=_cluster_secret(args),
    )
    agent = AgentConfig(args.key_prefix, settings.lease_s, settings.heartbeat_s,
                        settings.publish_interval_s)  # fmt: skip
    host = WorkerHost(spec, WorkerLaunch(spec, redis_url, agent).register()).start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    hosted = host.wait_ready(settings.ready_timeout_s)
    log.info("worker %s serving at %s", hosted.worker_id, hosted.address)
    while not stop.wait(0.5):
        if host.wait_stopped(0):
            raise RuntimeError(f"worker {hosted.worker_id} stopped on its own")
    left = host.drain(args.grace_s)
    if left:
        log.warning("%d requests still running after %.0f s; stopping", left, args.grace_s)
    host.stop()
    return 0


def run_router(args: argparse.Namespace) -> int:
    from pdserve.router.event_loop import run as run_loop

    _configure(args)
    run_loop(_serve_router(args))
    return 0


async def _serve_router(args: argparse.Namespace) -> None:
    from pdserve.cluster.router_start import RedisRouterSpec, redis_routers
    from pdserve.router.config import RouterConfig

    spec = RedisRouterSpec(args.redis_url, args.key_prefix, Settings.from_env().lease_s,
                           args.model, _cluster_secret(args))  # fmt: skip
    config = RouterConfig(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        block_size=args.block_size,
        reuse_port=args.router_processes > 1,
        **routing_fields(args),
        **front_door_fields(args),
        **slo_fields(args),
    )
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with redis_routers(spec, config, args.router_processes) as routers:
        service = routers.service
        log.info("router serving HTTP on %s:%d, gRPC on %s:%d", args.host, service.http_port,
                 args.host, service.grpc_port)  # fmt: skip
        await stop.wait()
