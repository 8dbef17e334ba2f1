"""How the cluster's workers are started, published by the head for the hosts that join.

A worker on a joined host must match the head's: the same model and dtype (the router
tokenizes for one model), the same KV backend and block size (a sender and a receiver of
one transfer speak one backend and one block shape), the same lease and key prefix. `pdserve
up` publishes its worker template in Redis (``RedisKeys.worker_template``, JSON); `pdserve
join` reads it and starts its workers from it, on its own host's address. What belongs to a
host stays out: its address, CPU pinning, disk tier directories.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import redis

from pdserve.cluster.worker_agent import AgentConfig
from pdserve.cluster.worker_launch import WorkerLaunch
from pdserve.proto.redis_keys import RedisKeys
from pdserve.worker.host import WorkerSpec

# Every host binds its own address and port; the secret never goes to Redis (a joining
# host has it from its join token).
_NOT_SHARED = ("host", "port", "cluster_secret")


def template_json(launch: WorkerLaunch) -> str:
    """The cluster-wide part of ``launch``, as JSON."""
    spec = launch.worker
    worker = {
        f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in _NOT_SHARED
    }
    return json.dumps({
        "worker": worker,
        "agent": dataclasses.asdict(launch.agent),
        "log_level": launch.log_level,
        "role_args": {role: list(args) for role, args in launch.role_args.items()},
    })  # fmt: skip


def launch_from_json(text: str, redis_url: str, host: str) -> WorkerLaunch:
    """A launch for this host's workers (bound to ``host``) from the head's template."""
    data: dict[str, Any] = json.loads(text)
    worker = dict(data["worker"], extra_args=tuple(data["worker"]["extra_args"]), host=host)
    return WorkerLaunch(
        worker=WorkerSpec(**worker),
        redis_url=redis_url,
        agent=AgentConfig(**data["agent"]),
        log_level=data["log_level"],
        role_args={role: tuple(args) for role, args in data["role_args"].items()},
    )


def publish_template(client: redis.Redis, keys: RedisKeys, launch: WorkerLaunch) -> None:
    client.set(keys.worker_template, template_json(launch))


def read_template(client: redis.Redis, keys: RedisKeys, redis_url: str, host: str) -> WorkerLaunch:
    """This host's launch from the template in Redis; ValueError when no head wrote one."""
    raw = client.get(keys.worker_template)
    if raw is None:
        raise ValueError(
            f"Redis holds no worker template under the prefix {keys.prefix!r}: is `pdserve up "
            "--head` running there, and is the join token its latest?"
        )
    return launch_from_json(raw.decode() if isinstance(raw, bytes) else raw, redis_url, host)
