"""The autoscaler's Kubernetes actuator: sets the replica count of the prefill and decode pools
by writing the ``scale`` subresource of two Deployments (see ``pdserve.cluster.actuators``).

``KubernetesActuator`` talks to the API server through the official ``kubernetes`` client,
imported only when an actuator is built (``KubernetesActuator.from_config``), never when this
module is imported. It touches exactly two objects, the scale subresources (apps/v1
``deployments/{name}/scale``) of the two Deployments named in its config, with two calls:
``read_namespaced_deployment_scale`` and ``replace_namespaced_deployment_scale``. A write
carries the resourceVersion it read, so it never overwrites a change it has not seen (another
autoscaler, ``kubectl scale``): the API server answers 409 Conflict, and the actuator reads
again and re-applies, at most ``max_attempts`` times with a short, growing, jittered pause,
then raises ``ScaleConflictError``. Any other refusal from the API server, or no answer at all,
is a ``ScaleError`` naming the Deployment and the HTTP status.

Credentials, in this order: ``host`` (a plain URL, no credentials: ``kubectl proxy`` or a test
server), ``kubeconfig`` (a file, optionally a ``context``), else the pod's service account
(in-cluster config). The service account needs ``get``, ``update`` on
``deployments/scale`` in the namespace, nothing else.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pdserve.cluster.actuators import POOLS

log = logging.getLogger("pdserve.autoscale.kubernetes")

REQUIREMENT = "kubernetes>=31"

# Kubernetes object names: a namespace is a DNS-1123 label, a Deployment a DNS-1123 subdomain.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

_CONFLICT = 409


class ScaleError(RuntimeError):
    """The API server refused a read or a write of a scale subresource, or did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, None when no answer came


class ScaleConflictError(ScaleError):
    """Every attempt of a write met 409 Conflict: another writer kept changing the object."""


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


class KubernetesActuator:
    """An ``Actuator`` over the scale subresources of two Deployments (see the module doc)."""

    def __init__(self, config: KubernetesActuatorConfig, api_client: Any) -> None:
        """``api_client``: a ``kubernetes.client.ApiClient`` (``build_api_client``)."""
        k8s = load_kubernetes()
        import urllib3  # a dependency of kubernetes

        self._config = config
        self._client = k8s.client
        self._api_client = api_client
        self._apps = k8s.client.AppsV1Api(api_client)
        self._api_error: type[Exception] = k8s.client.ApiException
        self._transport_error: type[Exception] = urllib3.exceptions.HTTPError

    @classmethod
    def from_config(cls, config: KubernetesActuatorConfig) -> KubernetesActuator:
        """The actuator with its own API client; ImportError if ``kubernetes`` is missing."""
        return cls(config, build_api_client(config))

    @property
    def config(self) -> KubernetesActuatorConfig:
        return self._config

    def replicas(self, pool: str) -> int:
        name = self._config.deployment(pool)
        return _spec_replicas(self._read(pool, name))

    def scale(self, pool: str, replicas: int) -> None:
        name = self._config.deployment(pool)
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise TypeError(f"replicas must be an int, got {replicas!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas} for pool {pool!r}")
        namespace = self._config.namespace
        attempts = self._config.max_attempts
        for attempt in range(1, attempts + 1):
            current = self._read(pool, name)
            before = _spec_replicas(current)
            if before == replicas:
                log.debug("pool %s (%s/%s) already has %d replicas", pool, namespace, name, before)
                return
            body = self._client.V1Scale(
                api_version="autoscaling/v1",
                kind="Scale",
                metadata=self._client.V1ObjectMeta(
                    name=name,
                    namespace=namespace,
                    resource_version=current.metadata.resource_version,
                ),
                spec=self._client.V1ScaleSpec(replicas=replicas),
            )
            try:
                self._apps.replace_namespaced_deployment_scale(
                    name,
                    namespace,
                    body,
                    field_manager=self._config.field_manager,
                    _request_timeout=self._config.request_timeout_s,
                )
            except self._api_error as exc:
                status = getattr(exc, "status", None)
                if status != _CONFLICT:
                    raise self._failure("writing", pool, name, exc) from exc
                if attempt == attempts:
                    raise ScaleConflictError(
                        f"scaling pool {pool!r} (deployment {namespace}/{name}) to {replicas} "
                        f"replicas gave up after {attempts} attempts: 409 Conflict each time "
                        "(another writer kept changing its scale)",
                        status,
                    ) from exc
                pause = self._backoff(attempt)
                log.info(
                    "pool %s (%s/%s): 409 Conflict on attempt %d/%d, reading again in %.3f s",
                    pool,
                    namespace,
                    name,
                    attempt,
                    attempts,
                    pause,
                )
                time.sleep(pause)
                continue
            except self._transport_error as exc:
                raise self._failure("writing", pool, name, exc) from exc
            log.info(
                "scaled pool %s (deployment %s/%s): %d -> %d replicas",
                pool,
                namespace,
                name,
                before,
                replicas,
            )
            return

    def close(self) -> None:
        """Close the API client's connections."""
        close = getattr(self._api_client, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> KubernetesActuator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, pool: str, name: str) -> Any:
        try:
            return self._apps.read_namespaced_deployment_scale(
                name, self._config.namespace, _request_timeout=self._config.request_timeout_s
            )
        except (self._api_error, self._transport_error) as exc:
            raise self._failure("reading", pool, name, exc) from exc

    def _backoff(self, attempt: int) -> float:
        pause = min(self._config.backoff_s * 2 ** (attempt - 1), self._config.max_backoff_s)
        return pause * random.uniform(0.5, 1.0)

    def _failure(self, doing: str, pool: str, name: str, exc: Exception) -> ScaleError:
        where = f"deployment {self._config.namespace}/{name} (pool {pool!r})"
        status = getattr(exc, "status", None) if isinstance(exc, self._api_error) else None
        if status is None:
            return ScaleError(f"{doing} the scale of {where}: no answer from the API server: {exc}")
        reason = getattr(exc, "reason", None) or ""
        detail = _status_message(getattr(exc, "body", None))
        return ScaleError(
            f"{doing} the scale of {where}: HTTP {status} {reason}".rstrip()
            + (f": {detail}" if detail else ""),
            status,
        )


def _spec_replicas(scale: Any) -> int:
    # The API server omits spec.replicas when it is 0.
    spec = getattr(scale, "spec", None)
    replicas = getattr(spec, "replicas", None)
    return int(replicas) if replicas is not None else 0


def _status_message(body: Any) -> str:
    """The ``message`` of a Kubernetes ``Status`` body, else the body itself (shortened)."""
    if not body:
        return ""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    try:
        message = json.loads(text).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else text[:200]
