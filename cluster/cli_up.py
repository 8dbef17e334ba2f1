"""`pdserve up` (start a cluster) and `pdserve scale` (resize a pool of a running one)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
from pathlib import Path
from typing import Any

from pdserve.cluster.cli_autoscale import add_autoscale_arguments, autoscale_settings
from pdserve.cluster.cli_join import check_host_name
from pdserve.cluster.cpu_affinity import parse_cpu_affinity
from pdserve.cluster.front_door import add_front_door_arguments, front_door_fields
from pdserve.cluster.routing_options import add_routing_arguments, routing_fields
from pdserve.cluster.settings import Settings
from pdserve.cluster.slo_options import add_slo_arguments, slo_fields
from pdserve.engine.device_options import add_device_arguments, device_flags, device_settings
from pdserve.engine.kv_cache.tier_options import (
    add_kv_cache_dtype_argument,
    add_kv_tier_arguments,
    kv_tier_settings,
)
from pdserve.engine.speculative.options import (
    add_speculative_arguments,
    speculative_config,
    speculative_flags,
)

DEFAULT_STATE_FILE = Path.home() / ".pdserve" / "up.json"
DEFAULT_PROFILE_FILE = Path.home() / ".pdserve" / "profile.json"  # `pdserve profile` writes it


def add_parser(sub: Any) -> None:
    settings = Settings.from_env()
    p = sub.add_parser(
        "up",
        help="start Redis, Ray, the worker pools and the router",
        description="Start (or join) Ray, start the embedded redis-server unless --redis-url, "
        "launch the prefill/decode (or colocated) workers as Ray actors, and serve OpenAI HTTP "
        "and gRPC until Ctrl-C / SIGTERM. Defaults come from PDSERVE_* variables "
        "(cluster/settings.py).",
    )
    add = p.add_argument
    add("--model", default="smollm2-135m-instruct", help="model name or path")
    add("--dtype", default="float32", choices=["float32", "bfloat16"])
    add("--kv-backend", default="nixl", choices=["nixl", "tcp"], help="KV transfer backend")
    add("--prefill", type=int, default=None,
        help="prefill workers (default 1; 0 with --colocated or --head)")  # fmt: skip
    add("--decode", type=int, default=None,
        help="decode workers (default 1; 0 with --colocated or --head)")  # fmt: skip
    add("--colocated", type=int, default=0, help="workers that run both phases (default 0)")
    add("--ray-address", default=settings.ray_address, help="join this Ray cluster")
    add("--redis-url", default=settings.redis_url, help="external Redis (default: embedded)")
    add("--head", action="store_true",
        help="the head of a cluster of several hosts: Redis, Ray and the router listen on this "
        "host's address, and the command that adds another host (`pdserve join`) is "
        "printed")  # fmt: skip
    add("--name", default=socket.gethostname(),
        help="this host's name in the cluster (its Ray node label; default: the "
        "hostname)")  # fmt: skip
    add("--advertise-address", default=settings.advertise_address, metavar="IP",
        help="with --head: the address other hosts reach this one at (default: "
        "PDSERVE_ADVERTISE_ADDRESS, else the default route's interface)")  # fmt: skip
    add("--host", default=None,
        help="router bind address (default 127.0.0.1; 0.0.0.0 with --head)")  # fmt: skip
    add("--http-port", type=int, default=8000)
    add("--grpc-port", type=int, default=50051)
    add("--dashboard", action=argparse.BooleanOptionalAction, default=None,
        help="Ray dashboard of a local cluster (default: Ray's choice)")  # fmt: skip
    add("--worker-host", default=None,
        help="address workers bind and advertise (default 127.0.0.1; the node IP with "
        "--head or --ray-address)")  # fmt: skip
    add("--num-blocks", type=int, default=None, help="KV pool blocks per worker")
    add("--block-size", type=int, default=16)
    add_device_arguments(p)
    add_kv_cache_dtype_argument(p)
    add("--worker-arg", action="append", default=[], metavar="ARG",
        help="extra flag for every worker (see python -m pdserve.worker.server -h)")  # fmt: skip
    add_routing_arguments(p, "default routing policy of the router")
    add("--router-processes", type=int, default=1, metavar="N",
        help="router processes sharing the ports (SO_REUSEPORT): one serves about 1,000 "
        "requests/s; each client connection stays with one process (default 1)")  # fmt: skip
    add("--cpu-affinity", default=None, metavar="ROLE=CORES;...",
        help="pin workers to CPU cores, e.g. "
        "'prefill=0;decode=1' or 'colocated=0,1' (slot i -> i-th core; default: "
        "PDSERVE_CPU_AFFINITY, else not pinned)")  # fmt: skip
    add("--max-restarts", type=int, default=settings.max_restarts)
    add("--state-file", type=Path, default=DEFAULT_STATE_FILE,
        help="where the endpoints go once serving, mode 0600 (default: %(default)s)")  # fmt: skip
    add("--cluster-auth", action=argparse.BooleanOptionalAction, default=True,
        help="secure the inside with a cluster secret: mutual TLS to the workers, "
        "authenticated KV transfer, Redis password, Ray token (default: on)")  # fmt: skip
    add("--cluster-secret-file", type=Path, default=settings.cluster_secret_file,
        metavar="PATH", help="the cluster secret, kept (mode 0600; made if missing; default: "
        "PDSERVE_CLUSTER_SECRET_FILE, else a new one per start beside the state file)")  # fmt: skip
    add_front_door_arguments(p, settings)
    add_slo_arguments(p)
    add("--log-level", default=settings.log_level)
    add("--worker-log-level", default="WARNING")
    add("--autoscale", action="store_true",
        help="size the prefill and decode pools to the load (the planner; profile from "
        f"--profile, else {DEFAULT_PROFILE_FILE})")  # fmt: skip
    add_autoscale_arguments(p, "--planner-metrics-port")
    add_kv_tier_arguments(p, per_worker_dirs=True)
    add_speculative_arguments(p)
    p.set_defaults(run=run_up_command)
    _add_scale_parser(sub)


def run_up_command(args: argparse.Namespace) -> int:
    from pdserve.cluster.up import run_up

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_up(build_up_config(args, Settings.from_env()))


def build_up_config(args: argparse.Namespace, settings: Settings) -> Any:
    """Flags + settings -> UpConfig (ValueError on a bad combination)."""
    from pdserve.cluster.pool_manager import PoolTargets
    from pdserve.cluster.ray_pools import ActorResources
    from pdserve.cluster.secret import secret_source
    from pdserve.cluster.up import UpConfig
    from pdserve.cluster.worker_agent import AgentConfig
    from pdserve.cluster.worker_launch import WorkerLaunch
    from pdserve.router.config import RouterConfig
    from pdserve.worker.host import WorkerSpec

    colocated_only = args.colocated > 0 and args.prefill is None and args.decode is None
    default_pool = 0 if colocated_only or args.head else 1
    targets = PoolTargets(
        prefill=default_pool if args.prefill is None else args.prefill,
        decode=default_pool if args.decode is None else args.decode,
        colocated=args.colocated,
    )
    if not args.head:  # a head's own pools need not serve alone: other hosts join
        targets.check_serves()
    agent = AgentConfig(
        key_prefix=settings.key_prefix,
        lease_s=settings.lease_s,
        heartbeat_s=settings.heartbeat_s,
        publish_interval_s=settings.publish_interval_s,
    )
    worker_args = [
        "--block-size", str(args.block_size), "--kv-cache-dtype", args.kv_cache_dtype,
        *device_flags(device_settings(args)), *args.worker_arg,
    ]  # fmt: skip
    if args.num_blocks is not None:
        worker_args += ["--num-blocks", str(args.num_blocks)]
    speculation = speculative_flags(speculative_config(args))
    worker_host = args.worker_host or ("auto" if args.ray_address or args.head else "127.0.0.1")
    spec = WorkerSpec(
        role="prefill",
        worker_id="template-0",
        host=worker_host,
        model=args.model,
        dtype=args.dtype,
        kv_backend=args.kv_backend,
        extra_args=tuple(worker_args),
        torch_threads=settings.torch_threads,
    )
    worker = WorkerLaunch(
        spec,
        redis_url="",
        agent=agent,
        log_level=args.worker_log_level.upper(),
        role_args={"decode": tuple(speculation), "colocated": tuple(speculation)},
        kv_tiers=kv_tier_settings(args),
        cpu_affinity=(
            settings.cpu_affinity
            if args.cpu_affinity is None
            else parse_cpu_affinity(args.cpu_affinity)
        ),
    )
    router = RouterConfig(
        host=args.host or ("0.0.0.0" if args.head else "127.0.0.1"),
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        block_size=args.block_size,
        **routing_fields(args),
        **front_door_fields(args),
        **slo_fields(args),
    )
    if args.router_processes < 1:
        raise ValueError(f"--router-processes must be >= 1, got {args.router_processes}")
    autoscale = None
    if args.autoscale:
        if targets.prefill == 0:
            raise ValueError("--autoscale sizes the prefill and decode pools: give --prefill "
                             "and --decode, not --colocated alone")  # fmt: skip
        stored = DEFAULT_PROFILE_FILE.read_text() if DEFAULT_PROFILE_FILE.exists() else None
        autoscale = autoscale_settings(args, stored)
        if args.head:  # the planner's /metrics, like the router's, for the other hosts
            autoscale = dataclasses.replace(autoscale, metrics_host=router.host)
    secret = None
    if args.cluster_auth:
        secret = secret_source(args.cluster_secret_file, args.state_file)
    elif args.cluster_secret_file is not None:
        raise ValueError("--no-cluster-auth contradicts --cluster-secret-file (or "
                         "PDSERVE_CLUSTER_SECRET_FILE)")  # fmt: skip
    return UpConfig(
        targets=targets,
        worker=worker,
        resources=ActorResources(settings.worker_num_cpus, 0.0, args.max_restarts),
        num_gpus_per_worker=settings.worker_num_gpus,
        router=router,
        ray_address=args.ray_address,
        redis_url=args.redis_url,
        include_dashboard=args.dashboard,
        state_file=args.state_file,
        ready_timeout_s=settings.ready_timeout_s,
        drain_timeout_s=settings.drain_timeout_s,
        router_processes=args.router_processes,
        autoscale=autoscale,
        secret=secret,
        head=_head_settings(args),
    )


def _head_settings(args: argparse.Namespace) -> Any:
    """``--head``: this host's name, where the join token goes, the advertised address."""
    from pdserve.cluster.up import HeadSettings

    if not args.head:
        return None
    token_file = args.state_file.with_suffix(".join-token")
    return HeadSettings(check_host_name(args.name), token_file, args.advertise_address)


def _add_scale_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scale",
        help="resize a pool of a running cluster",
        description="Set the target size of one pool; `pdserve up` starts new workers (they "
        "register once warm) or drains surplus ones (deregister, finish running requests, stop).",
    )
    p.add_argument("role", choices=["prefill", "decode", "colocated"])
    p.add_argument("count", type=int)
    p.add_argument("--redis-url", default=None, help="default: from the state file")
    p.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    p.set_defaults(run=run_scale_command)


def run_scale_command(args: argparse.Namespace) -> int:
    from pdserve.cluster.cli_status import connect_from_args
    from pdserve.cluster.pool_control import PoolTargetStore

    client, keys, _url = connect_from_args(args)
    store = PoolTargetStore(client, keys)
    current = store.stored()
    if current is None:
        raise ValueError("Redis holds no pool sizes: is `pdserve up` running against it?")
    targets = store.set(args.role, args.count, current)
    print(f"target sizes: prefill {targets.prefill}, decode {targets.decode}, "
          f"colocated {targets.colocated}")  # fmt: skip
    return 0
