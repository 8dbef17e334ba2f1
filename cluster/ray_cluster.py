"""Starting or joining Ray for `pdserve up`.

Ray >= 2.59 turns token authentication on for local clusters it starts: ``ray.init()``
writes a token to ``~/.ray/auth_token`` and uses it, so a local start needs nothing from the
user. Joining a cluster (``--ray-address``) that uses tokens needs that cluster's token in
``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``; ``RAY_AUTH_MODE=disabled`` opts out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(slots=True, frozen=True)
class RayEndpoints:
    address: str  # the GCS address others can join
    dashboard_url: str | None  # http://host:port, or None without the dashboard
    started_here: bool  # we started a local cluster (and stop it on exit)


def start_or_join_ray(
    address: str | None,
    num_cpus: float | None = None,
    include_dashboard: bool | None = None,
    log_to_driver: bool = True,
    node_ip_address: str | None = None,
    labels: dict[str, str] | None = None,
) -> RayEndpoints:
    """Join the cluster at ``address``, or start a local one (``num_cpus`` logical CPUs:
    may exceed the cores, so that several CPU workers fit on a small machine).

    ``node_ip_address``: the address this node binds and other nodes reach it at (Ray's own
    guess needs a route to the internet, else it takes 127.0.0.1); ``labels``: the node
    labels of a local cluster's node (pools place workers by them)."""
    kwargs: dict[str, Any] = {"log_to_driver": log_to_driver, "logging_level": logging.WARNING}
    if node_ip_address is not None:
        kwargs["_node_ip_address"] = node_ip_address
    if address is None:
        kwargs["num_cpus"] = None if num_cpus is None else max(1, math.ceil(num_cpus))
        kwargs["include_dashboard"] = include_dashboard
        kwargs["labels"] = labels
    try:
        # "local": always a new cluster, never one a stale /tmp/ray/ray_current_cluster names
        context = ray.init(address=address or "local", **kwargs)
    except ConnectionError as err:
        if address is None:
            raise
        raise ValueError(
            f"could not join the Ray cluster at {address} ({err}). If it uses token "
            "authentication (the default of clusters Ray >= 2.59 starts), an explicit address "
            "needs RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or "
            "~/.ray/auth_token; `--ray-address auto` finds a local cluster and its token"
        ) from err
    dashboard = context.dashboard_url or None
    if dashboard and not dashboard.startswith("http"):
        dashboard = f"http://{dashboard}"
    gcs = ray.get_runtime_context().gcs_address
    return RayEndpoints(gcs, dashboard, started_here=address is None)


def gpus_available() -> bool:
    return float(ray.cluster_resources().get("GPU", 0.0)) > 0
