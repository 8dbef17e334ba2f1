"""Every ``PDSERVE_*`` environment variable, read here and nowhere else, typed and checked.

``Settings.from_env()`` is called once by the CLI; its values become the defaults of the
command-line flags (a flag beats the variable) and then flow into the per-component config
dataclasses. Ray actors and worker processes get those dataclasses, never the environment.

| variable | type | default | what |
|---|---|---|---|
| ``PDSERVE_REDIS_URL`` | str | (embedded) | external Redis; unset = start redis-server |
| ``PDSERVE_RAY_ADDRESS`` | str | (local) | join this Ray cluster; unset = start one |
| ``PDSERVE_ADVERTISE_ADDRESS`` | str | (chosen) | this host's address for other hosts |
| ``PDSERVE_JOIN_TOKEN`` | str | (none) | `pdserve join --token` (kept out of ``ps``) |
| ``PDSERVE_KEY_PREFIX`` | str | ``pdserve:`` | prefix of every Redis key |
| ``PDSERVE_LEASE_S`` | float | 5 | worker registration lease |
| ``PDSERVE_HEARTBEAT_S`` | float | 1 | worker heartbeat period (< lease) |
| ``PDSERVE_PUBLISH_INTERVAL_S`` | float | 0.05 | how often workers publish KV events |
| ``PDSERVE_WORKER_NUM_CPUS`` | float | 1 | Ray CPUs per worker actor (no GPU) |
| ``PDSERVE_WORKER_NUM_GPUS`` | float | 1 | Ray GPUs per worker actor (GPU nodes) |
| ``PDSERVE_MAX_RESTARTS`` | int | 3 | Ray restarts of a failed worker (-1: forever) |
| ``PDSERVE_READY_TIMEOUT_S`` | float | 600 | wait for workers to load and warm up |
| ``PDSERVE_DRAIN_TIMEOUT_S`` | float | 30 | wait for running requests on scale-down |
| ``PDSERVE_TORCH_THREADS`` | int | 1 | torch threads per worker (0: torch's default) |
| ``PDSERVE_CPU_AFFINITY`` | str | (none) | pin workers: ``prefill=0;decode=1;colocated=0,1`` |
| ``PDSERVE_LOG_LEVEL`` | str | ``INFO`` | log level of pdserve's processes |
| ``PDSERVE_CLUSTER_SECRET_FILE`` | path | (new per `up`) | the cluster secret (mode 0600) |
| ``PDSERVE_API_KEYS_FILE`` | path | (none) | router API keys, one per line |
| ``PDSERVE_TLS_CERT`` | path | (none) | router TLS certificate (PEM), HTTP and gRPC |
| ``PDSERVE_TLS_KEY`` | path | (none) | its private key (PEM) |

Files, not values: a secret in a variable or a flag would show in ``ps`` and ``/proc``.
Ray reads its own variables (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``...); see cluster/secret.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pdserve.cluster.cpu_affinity import CpuAffinity, parse_cpu_affinity

T = TypeVar("T")
PREFIX = "PDSERVE_"


@dataclass(slots=True, frozen=True)
class Settings:
    redis_url: str | None = None
    ray_address: str | None = None
    advertise_address: str | None = None
    join_token: str | None = None
    key_prefix: str = "pdserve:"
    lease_s: float = 5.0
    heartbeat_s: float = 1.0
    publish_interval_s: float = 0.05
    worker_num_cpus: float = 1.0
    worker_num_gpus: float = 1.0
    max_restarts: int = 3
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    torch_threads: int = 1
    log_level: str = "INFO"
    cpu_affinity: CpuAffinity = ()  # per pool; worker slot i -> cores[i % len]
    cluster_secret_file: Path | None = None
    api_keys_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(
                f"{PREFIX}HEARTBEAT_S must be > 0 and below {PREFIX}LEASE_S, got "
                f"heartbeat {self.heartbeat_s} s, lease {self.lease_s} s"
            )
        positive = {
            "PUBLISH_INTERVAL_S": self.publish_interval_s,
            "READY_TIMEOUT_S": self.ready_timeout_s,
            "DRAIN_TIMEOUT_S": self.drain_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{PREFIX}{name} must be > 0, got {value}")
        if self.worker_num_cpus < 0 or self.worker_num_gpus < 0 or self.torch_threads < 0:
            raise ValueError(
                f"worker resources and torch threads must be >= 0, got num_cpus="
                f"{self.worker_num_cpus} num_gpus={self.worker_num_gpus} "
                f"torch_threads={self.torch_threads}"
            )
        if self.max_restarts < -1:
            raise ValueError(f"{PREFIX}MAX_RESTARTS must be >= -1, got {self.max_restarts}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``environ`` (default ``os.environ``); ValueError names a bad variable."""
        env = os.environ if environ is None else environ
        d = cls()
        return cls(
            redis_url=_get(env, "REDIS_URL", str, d.redis_url),
            ray_address=_get(env, "RAY_ADDRESS", str, d.ray_address),
            advertise_address=_get(env, "ADVERTISE_ADDRESS", str, d.advertise_address),
            join_token=_get(env, "JOIN_TOKEN", str, d.join_token),
            key_prefix=_get(env, "KEY_PREFIX", str, d.key_prefix),
            lease_s=_get(env, "LEASE_S", float, d.lease_s),
            heartbeat_s=_get(env, "HEARTBEAT_S", float, d.heartbeat_s),
            publish_interval_s=_get(env, "PUBLISH_INTERVAL_S", float, d.publish_interval_s),
            worker_num_cpus=_get(env, "WORKER_NUM_CPUS", float, d.worker_num_cpus),
            worker_num_gpus=_get(env, "WORKER_NUM_GPUS", float, d.worker_num_gpus),
            max_restarts=_get(env, "MAX_RESTARTS", int, d.max_restarts),
            ready_timeout_s=_get(env, "READY_TIMEOUT_S", float, d.ready_timeout_s),
            drain_timeout_s=_get(env, "DRAIN_TIMEOUT_S", float, d.drain_timeout_s),
            torch_threads=_get(env, "TORCH_THREADS", int, d.torch_threads),
            log_level=_get(env, "LOG_LEVEL", str, d.log_level).upper(),
            cpu_affinity=_get(env, "CPU_AFFINITY", parse_cpu_affinity, d.cpu_affinity),
            cluster_secret_file=_get(env, "CLUSTER_SECRET_FILE", Path, d.cluster_secret_file),
            api_keys_file=_get(env, "API_KEYS_FILE", Path, d.api_keys_file),
            tls_cert=_get(env, "TLS_CERT", Path, d.tls_cert),
            tls_key=_get(env, "TLS_KEY", Path, d.tls_key),
        )


def _get(env: Mapping[str, str], name: str, parse: Callable[[str], T], default: T) -> T:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw.strip())
    except ValueError as err:
        kind = getattr(parse, "__name__", str(parse))
        raise ValueError(f"{PREFIX}{name}={raw!r} is not a valid {kind}: {err}") from err
