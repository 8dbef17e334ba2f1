"""`pdserve join` (add this host to a cluster of several hosts) and `pdserve leave`."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

from pdserve.cluster.front_door import add_front_door_arguments, front_door_fields
from pdserve.cluster.routing_options import add_routing_arguments, routing_fields
from pdserve.cluster.settings import Settings
from pdserve.cluster.slo_options import add_slo_arguments, slo_fields

DEFAULT_STATE_FILE = Path.home() / ".pdserve" / "join.json"
ROLES = ("prefill", "decode", "colocated")
# A Ray label value, and a part of worker ids ([A-Za-z0-9._-]).
_HOST_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def check_host_name(name: str) -> str:
    if not _HOST_NAME_RE.fullmatch(name):
        raise ValueError(
            f"host name {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting and "
            "ending with a letter or digit; pass --name"
        )
    return name


def add_parsers(sub: Any) -> None:
    settings = Settings.from_env()
    p = sub.add_parser(
        "join",
        help="add this host, with workers (and a router), to a cluster led by `up --head`",
        description="Join the Ray cluster of `pdserve up --head` (the exact command is printed "
        "there) and start this host's workers, which register in the cluster's Redis and "
        "serve every router. SIGINT/SIGTERM or `pdserve leave` drains them and leaves.",
    )
    add = p.add_argument
    add("head_address", metavar="HEAD_ADDRESS", help="the head's Ray address, host:port")
    add("--token-file", type=Path, default=None,
        help="the join token file that `pdserve up --head` wrote (copy it here)")  # fmt: skip
    add("--token", default=settings.join_token, help=argparse.SUPPRESS)  # PDSERVE_JOIN_TOKEN
    for role in ROLES:
        add(f"--{role}", type=int, default=0, help=f"{role} workers on this host (default 0)")
    add("--name", default=socket.gethostname(),
        help="this host's name: its Ray node label, in its workers' ids (default: the "
        "hostname)")  # fmt: skip
    add("--advertise-address", default=settings.advertise_address, metavar="IP",
        help="the address other hosts reach this one at (default: PDSERVE_ADVERTISE_ADDRESS, "
        "else the one this host reaches the head from)")  # fmt: skip
    add("--num-blocks", type=int, default=None, help="KV pool blocks per worker on this host")
    add("--router", action="store_true", help="run a router on this host too")
    add("--router-host", default="0.0.0.0", help="the router's bind address")
    add("--http-port", type=int, default=8000)
    add("--grpc-port", type=int, default=50051)
    add_routing_arguments(p, "default routing policy of the router")
    add_front_door_arguments(p, settings)  # the router's: give it the head's front door
    add_slo_arguments(p)
    add("--state-file", type=Path, default=DEFAULT_STATE_FILE,
        help="where the joined host is recorded for `pdserve leave` (default: "
        "%(default)s)")  # fmt: skip
    add("--log-level", default=settings.log_level)
    p.set_defaults(run=run_join_command)
    q = sub.add_parser(
        "leave",
        help="drain this host's workers and take it out of the cluster",
        description="Stop the `pdserve join` running on this host: its router stops, its "
        "workers deregister and finish their running requests, its Ray node leaves.",
    )
    q.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    q.add_argument("--timeout-s", type=float, default=settings.drain_timeout_s + 60,
                   help="how long to wait for the drain (default: %(default)s)")  # fmt: skip
    q.set_defaults(run=run_leave_command)


def join_token(args: argparse.Namespace) -> Any:
    """The decoded ``--token``; ValueError saying where to find it."""
    from pdserve.cluster.join_token import JoinToken

    if args.token_file is not None:
        return JoinToken.decode(args.token_file.read_text())
    if not args.token:
        raise ValueError("--token-file (or PDSERVE_JOIN_TOKEN) is required: `pdserve up "
                         "--head` wrote the file and printed the join command")  # fmt: skip
    return JoinToken.decode(args.token)


def build_join_config(args: argparse.Namespace, settings: Settings) -> Any:
    """Flags + settings -> JoinConfig (ValueError on bad input)."""
    from pdserve.cluster.join import JoinConfig
    from pdserve.cluster.ray_pools import ActorResources
    from pdserve.router.config import RouterConfig

    workers = {role: getattr(args, role) for role in ROLES}
    if min(workers.values()) < 0:
        raise ValueError(f"worker counts must be >= 0, got {workers}")
    if not sum(workers.values()) and not args.router:
        raise ValueError("nothing to run here: give --prefill, --decode, --colocated or --router")
    router = None
    if args.router:
        router = RouterConfig(
            host=args.router_host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            **routing_fields(args),
            **front_door_fields(args),
            **slo_fields(args),
        )
    return JoinConfig(
        head_address=args.head_address,
        token=join_token(args),
        name=check_host_name(args.name),
        workers=workers,
        resources=ActorResources(settings.worker_num_cpus, 0.0, settings.max_restarts),
        state_file=args.state_file,
        advertise_address=args.advertise_address,
        worker_args=() if args.num_blocks is None else ("--num-blocks", str(args.num_blocks)),
        router=router,
        ready_timeout_s=settings.ready_timeout_s,
        drain_timeout_s=settings.drain_timeout_s,
    )


def run_join_command(args: argparse.Namespace) -> int:
    from pdserve.cluster.join_token import ray_auth_env

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Ray reads its authentication variables once, when it is imported (by cluster/join.py).
    token_file = args.state_file.with_suffix(".ray-token")  # join.ray_token_file
    os.environ.update(ray_auth_env(join_token(args), token_file))
    from pdserve.cluster.join import run_join

    return run_join(build_join_config(args, Settings.from_env()))


def run_leave_command(args: argparse.Namespace) -> int:
    from pdserve.cluster.join import leave

    host = leave(args.state_file, args.timeout_s)
    print(f"host {host.name} left the cluster ({len(host.workers)} workers drained)")
    return 0
