"""Reaching the Kubernetes API server: which two Deployments are the pools, the credentials,
and the ``kubernetes`` client, imported only when an actuator is built."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pdserve.cluster.actuators import POOLS

REQUIREMENT = "kubernetes>=31"

# Kubernetes object names: a namespace is a DNS-1123 label, a Deployment a DNS-1123 subdomain.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True, slots=True)
class KubernetesActuatorConfig:
    """Which two Deployments are the pools, and how to reach the API server."""

    namespace: str
    prefill_deployment: str
    decode_deployment: str
    # Credentials: host wins, then kubeconfig (with context), else the in-cluster service account.
    kubeconfig: str | None = None
    context: str | None = None
    host: str | None = None  # e.g. "http://127.0.0.1:8001" (kubectl proxy); sends no credentials
    max_attempts: int = 5  # writes per scale() before ScaleConflictError (409 Conflict each)
    backoff_s: float = 0.05  # pause after the first conflict; doubles, jittered to [50%, 100%]
    max_backoff_s: float = 1.0
    request_timeout_s: float = 10.0
    field_manager: str = "pdserve-autoscaler"

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"namespace must be a DNS-1123 label, got {self.namespace!r}")
        for field_name in ("prefill_deployment", "decode_deployment"):
            name = getattr(self, field_name)
            if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
                raise ValueError(f"{field_name} must be a Deployment name, got {name!r}")
        if self.prefill_deployment == self.decode_deployment:
            raise ValueError(
                f"prefill and decode must be two Deployments, both are {self.prefill_deployment!r}"
            )
        if self.host is not None and self.kubeconfig is not None:
            raise ValueError("give host or kubeconfig, not both")
        if self.context is not None and self.kubeconfig is None:
            raise ValueError("context needs kubeconfig")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def deployments(self) -> dict[str, str]:
        """Pool -> Deployment name."""
        return {"prefill": self.prefill_deployment, "decode": self.decode_deployment}

    def deployment(self, pool: str) -> str:
        """The Deployment of ``pool``; ValueError naming the known pools for any other name."""
        try:
            return self.deployments[pool]
        except (KeyError, TypeError):
            raise ValueError(f"unknown pool {pool!r}; known pools: {list(POOLS)}") from None


def load_kubernetes() -> ModuleType:
    """The ``kubernetes`` package with ``client`` and ``config`` loaded; ImportError naming the
    fix if it is not installed."""
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError as exc:
        raise ImportError(
            "the Kubernetes actuator needs the 'kubernetes' package "
            f"(pip install '{REQUIREMENT}'); it failed to import ({exc})"
        ) from exc
    return kubernetes


def build_api_client(config: KubernetesActuatorConfig) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``config``'s host, kubeconfig or service account."""
    k8s = load_kubernetes()
    configuration = k8s.client.Configuration()
    if config.host is not None:
        configuration.host = config.host
    elif config.kubeconfig is not None:
        k8s.config.load_kube_config(
            config_file=config.kubeconfig,
            context=config.context,
            client_configuration=configuration,
        )
    else:
        try:
            k8s.config.load_incluster_config(client_configuration=configuration)
        except k8s.config.ConfigException as exc:
            raise RuntimeError(
                f"no in-cluster Kubernetes config ({exc}); outside a pod, set kubeconfig or host"
            ) from exc
    return k8s.client.ApiClient(configuration)
