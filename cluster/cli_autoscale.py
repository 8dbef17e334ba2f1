"""`pdserve planner`: the autoscaler on its own (on Kubernetes, or publishing its decision as
metrics only), and the autoscaling flags it shares with `pdserve up --autoscale`.

The capacity profile comes from `pdserve profile`: a file (``--profile``) or, without one,
the profile that `pdserve profile --redis-url` stored in the cluster's Redis.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cluster.settings import Settings

if TYPE_CHECKING:
    from pdserve.cluster.actuators import Actuator, WorkerDrain
    from pdserve.cluster.autoscaler import AutoscaleSettings

log = logging.getLogger("pdserve.autoscale")


def add_autoscale_arguments(p: argparse.ArgumentParser, metrics_flag: str) -> None:
    """The planner's flags; ``metrics_flag`` names the port of its /metrics."""
    add = p.add_argument
    add(metrics_flag, dest="planner_metrics_port", type=int, default=None, metavar="PORT",
        help="serve pdserve_planner_* on PORT (0: any free port; -1 or unset: none)")  # fmt: skip
    add("--profile", type=Path, default=None,
        help="capacity profile from `pdserve profile` (default: the one in Redis)")  # fmt: skip
    add("--min-prefill", type=int, default=1, help="autoscaling: fewest prefill workers")
    add("--max-prefill", type=int, default=8, help="autoscaling: most prefill workers")
    add("--min-decode", type=int, default=1, help="autoscaling: fewest decode workers")
    add("--max-decode", type=int, default=8, help="autoscaling: most decode workers")
    add("--target-utilization", type=float, default=0.8,
        help="share of a worker's profiled capacity the pools are sized for: the operating "
        "point between worker-hours and headroom, up to 1.5 (above 1 when the profile is "
        "conservative; default 0.8)")  # fmt: skip
    add("--scale-up-cooldown-s", type=float, default=30.0,
        help="seconds between scale-ups, unless KV or the queue runs out (default 30)")  # fmt: skip
    add("--scale-down-cooldown-s", type=float, default=120.0,
        help="seconds after any change before a scale-down (default 120)")  # fmt: skip
    add("--scale-down-after-s", type=float, default=60.0,
        help="how long the load must fit one replica fewer first (default 60)")  # fmt: skip
    add("--load-window", default="10s",
        help="which of the routers' goodput windows gives the load (default 10s)")  # fmt: skip


def autoscale_settings(args: argparse.Namespace, stored_profile: str | None) -> AutoscaleSettings:
    """Flags -> settings; ``stored_profile`` is the JSON in Redis, used when no file is
    given (ValueError, saying how to make one, when there is neither)."""
    from pdserve.cluster.autoscale import CapacityProfile, PlannerConfig, PoolLimits
    from pdserve.cluster.autoscaler import AutoscaleSettings

    text = args.profile.read_text() if args.profile is not None else stored_profile
    if text is None:
        raise ValueError(
            "no capacity profile: run `pdserve profile --redis-url URL` once (it measures a "
            "worker of this machine and stores the result), or pass --profile FILE"
        )
    port = args.planner_metrics_port
    planner = PlannerConfig(
        prefill=PoolLimits(args.min_prefill, args.max_prefill),
        decode=PoolLimits(args.min_decode, args.max_decode),
        target_utilization=args.target_utilization,
        scale_up_cooldown_s=args.scale_up_cooldown_s,
        scale_down_cooldown_s=args.scale_down_cooldown_s,
        scale_down_sustain_s=args.scale_down_after_s,
    )
    return AutoscaleSettings(
        planner,
        CapacityProfile.from_dict(json.loads(text)["profile"]),
        window=args.load_window,
        metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
        metrics_port=None if port is None or port < 0 else port,
    )


def add_parser(sub: Any) -> None:
    settings = Settings.from_env()
    p = sub.add_parser(
        "planner",
        help="the autoscaler on its own: scale Kubernetes workloads, or export its decision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--apply", choices=["kubernetes", "metrics"], default="kubernetes",
        help="kubernetes: set the two Deployments' replicas; metrics: only export "
        "pdserve_planner_desired_replicas (for an HPA or KEDA)")  # fmt: skip
    add("--namespace", default="default")
    add("--prefill-deployment", default="pdserve-prefill")
    add("--decode-deployment", default="pdserve-decode")
    add("--kubernetes-host", default=None, metavar="URL",
        help="the API server at URL without credentials (e.g. `kubectl proxy`); default: the "
        "pod's service account")  # fmt: skip
    add("--redis-url", default=settings.redis_url, help="the cluster's Redis (PDSERVE_REDIS_URL)")
    add("--key-prefix", default=settings.key_prefix)
    add("--interval-s", type=float, default=5.0, help="seconds between decisions")
    add("--host", dest="metrics_host", default="0.0.0.0", help="address of /metrics")
    add("--log-level", default=settings.log_level)
    add_autoscale_arguments(p, "--metrics-port")
    p.set_defaults(run=run_planner, planner_metrics_port=9400)


def run_planner(args: argparse.Namespace) -> int:
    """Decide every ``--interval-s`` until killed."""
    import redis

    from pdserve.cluster.autoscaler import OrderedReplicas, RedisClusterView, build_autoscaler
    from pdserve.cluster.locality_index import LocalityIndex
    from pdserve.cluster.registry import WorkerRegistry
    from pdserve.cluster.worker_drain import DrainConfig, RegistryDrain
    from pdserve.proto.redis_keys import RedisKeys

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.redis_url:
        raise ValueError("--redis-url (or PDSERVE_REDIS_URL) is required")
    client = redis.Redis.from_url(args.redis_url, socket_timeout=2.0, decode_responses=False)
    keys = RedisKeys(args.key_prefix)
    stored = client.get(keys.capacity_profile)
    text = stored.decode() if isinstance(stored, bytes) else stored
    settings = autoscale_settings(args, text)
    env = Settings.from_env()
    registry = WorkerRegistry(client, keys, env.lease_s)
    # Drained before removal: settled once a heartbeat after the routers' refresh (0.25 s).
    drain = RegistryDrain(registry, DrainConfig(env.drain_timeout_s, env.heartbeat_s + 0.5))
    ordered = OrderedReplicas(_actuator(args, drain))

    index = LocalityIndex(client, keys)
    view = RedisClusterView(
        client, args.key_prefix, registry, index, ordered.members, settings.window
    )
    autoscaler = build_autoscaler(settings, ordered.actuator, view)
    while True:
        try:
            ordered.refresh(time.monotonic())
            autoscaler.tick(time.monotonic())
        except (redis.RedisError, OSError) as err:
            log.warning("no decision this interval: %r", err)
        time.sleep(args.interval_s)


def _actuator(args: argparse.Namespace, drain: WorkerDrain) -> Actuator:
    from pdserve.cluster.actuators import MetricsOnlyActuator

    if args.apply == "metrics":
        return MetricsOnlyActuator()
    from pdserve.cluster.actuators.kubernetes import KubernetesActuator
    from pdserve.cluster.actuators.kubernetes_client import KubernetesActuatorConfig

    config = KubernetesActuatorConfig(
        args.namespace, args.prefill_deployment, args.decode_deployment, host=args.kubernetes_host
    )
    return KubernetesActuator.from_config(config, drain)
