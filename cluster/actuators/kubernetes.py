"""The autoscaler's Kubernetes actuator: sets the replica count of the prefill and decode pools
by writing the ``scale`` subresource of two Deployments (see ``pdserve.cluster.actuators``).

``KubernetesActuator`` talks to the API server through the official ``kubernetes`` client,
imported only when an actuator is built (``KubernetesActuator.from_config``), never when this
module is imported. It scales through the scale subresources (apps/v1
``deployments/{name}/scale``) of the two Deployments named in its config, with two calls:
``read_namespaced_deployment_scale`` and ``replace_namespaced_deployment_scale``. A write
carries the resourceVersion it read, so it never overwrites a change it has not seen (another
autoscaler, ``kubectl scale``): the API server answers 409 Conflict, and the actuator reads
again and re-applies, at most ``max_attempts`` times with a short, growing, jittered pause,
then raises ``ScaleConflictError``. Any other refusal from the API server, or no answer at all,
is a ``ScaleError`` naming the Deployment and the HTTP status.

A scale-in removes the workers the planner chose (``remove``: locality, then load), in three
steps: drain them (``WorkerDrain``: no new requests, running ones finish), give their pods
the lowest ``controller.kubernetes.io/pod-deletion-cost`` (``kubernetes_pods.py``: only pods
of that Deployment's selector, listed with ``list_namespaced_pod`` and patched with
``patch_namespaced_pod``), and only then lower the replicas, so that the ReplicaSet
controller deletes those pods. If a step fails, the drained workers are released.

Credentials, in this order: ``host`` (a plain URL, no credentials: ``kubectl proxy`` or a test
server), ``kubeconfig`` (a file, optionally a ``context``), else the pod's service account
(in-cluster config). The service account needs ``get``, ``update`` on
``deployments/scale`` and, for the choice on scale-in, ``list``, ``patch`` on ``pods`` in
the namespace, nothing else.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from pdserve.cluster.actuators import WorkerDrain
from pdserve.cluster.actuators.kubernetes_client import (
    KubernetesActuatorConfig,
    build_api_client,
    load_kubernetes,
)
from pdserve.cluster.actuators.kubernetes_pods import (
    WorkloadPods,
    deletion_cost_patches,
    selector_labels,
)

log = logging.getLogger("pdserve.autoscale.kubernetes")
_CONFLICT = 409


class ScaleError(RuntimeError):
    """The API server refused a read or a write (of a scale subresource or, on scale-in, of
    the Deployment's pods), or did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, None when no answer came


class ScaleConflictError(ScaleError):
    """Every attempt of a write met 409 Conflict: another writer kept changing the object."""


class KubernetesActuator:
    """An ``Actuator`` over the scale subresources of two Deployments (see the module doc)."""

    def __init__(
        self, config: KubernetesActuatorConfig, api_client: Any, drain: WorkerDrain | None = None
    ) -> None:
        """``api_client``: a ``kubernetes.client.ApiClient`` (``build_api_client``);
        ``drain``: how workers are drained before their pods go (None: not drained here;
        the pod still drains itself on SIGTERM)."""
        k8s = load_kubernetes()
        import urllib3  # a dependency of kubernetes

        self._config = config
        self._client = k8s.client
        self._api_client = api_client
        self._apps = k8s.client.AppsV1Api(api_client)
        self._pods = WorkloadPods(
            k8s.client.CoreV1Api(api_client), config.namespace, config.request_timeout_s
        )
        self._drain = drain
        self._api_error: type[Exception] = k8s.client.ApiException
        self._transport_error: type[Exception] = urllib3.exceptions.HTTPError

    @classmethod
    def from_config(
        cls, config: KubernetesActuatorConfig, drain: WorkerDrain | None = None
    ) -> KubernetesActuator:
        """The actuator with its own API client; ImportError if ``kubernetes`` is missing."""
        return cls(config, build_api_client(config), drain)

    @property
    def config(self) -> KubernetesActuatorConfig:
        return self._config

    def replicas(self, pool: str) -> int:
        name = self._config.deployment(pool)
        return _spec_replicas(self._read(pool, name))

    def scale(self, pool: str, replicas: int, remove: Sequence[str] = ()) -> None:
        """Set the pool's replicas; on scale-in, drain the workers in ``remove`` (cheapest
        first) and mark their pods to go first, before the replicas drop."""
        name = self._config.deployment(pool)
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise TypeError(f"replicas must be an int, got {replicas!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas} for pool {pool!r}")
        drained: tuple[str, ...] = ()
        if remove:
            current = self._read(pool, name)
            surplus = _spec_replicas(current) - replicas
            if surplus > 0:
                drained = self._mark_for_removal(pool, name, current, tuple(remove)[:surplus])
        try:
            self._write_scale(pool, name, replicas)
        except ScaleError:
            self._release(drained)
            raise

    def _write_scale(self, pool: str, name: str, replicas: int) -> None:
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
                    raise self._failure("writing the scale of", pool, name, exc) from exc
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
                raise self._failure("writing the scale of", pool, name, exc) from exc
            log.info(
                "scaled pool %s (deployment %s/%s): %d -> %d replicas",
                pool,
                namespace,
                name,
                before,
                replicas,
            )
            return

    def _mark_for_removal(
        self, pool: str, name: str, scale: Any, remove: tuple[str, ...]
    ) -> tuple[str, ...]:
        """Drain the workers of ``remove`` that are pods of this Deployment and give those
        pods the lowest deletion cost; returns the workers drained."""
        labels = selector_labels(getattr(scale.status, "selector", None))
        if labels is None:
            log.warning(
                "pool %s (deployment %s): its selector %r is not key=value terms; the "
                "ReplicaSet controller picks the pods to remove",
                pool,
                name,
                getattr(scale.status, "selector", None),
            )
            return ()
        try:
            pods = self._pods.matching(labels)
        except (self._api_error, self._transport_error) as exc:
            raise self._failure("listing the pods of", pool, name, exc) from exc
        names = {p.name for p in pods}
        chosen = tuple(w for w in remove if w in names)
        if len(chosen) < len(remove):
            log.info("pool %s: no pod of deployment %s is named %s (still starting?); the "
                     "controller picks instead", pool, name,
                     [w for w in remove if w not in names])  # fmt: skip
        if self._drain is not None and chosen:
            self._drain.drain(chosen)
        try:
            for pod_name, cost in deletion_cost_patches(pods, chosen).items():
                self._pods.set_deletion_cost(pod_name, cost)
        except (self._api_error, self._transport_error) as exc:
            self._release(chosen)
            raise self._failure("annotating the pods of", pool, name, exc) from exc
        log.info("pool %s: pods %s drained and marked to go first", pool, list(chosen))
        return chosen

    def _release(self, drained: tuple[str, ...]) -> None:
        if self._drain is not None and drained:
            self._drain.release(drained)

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
            raise self._failure("reading the scale of", pool, name, exc) from exc

    def _backoff(self, attempt: int) -> float:
        pause = min(self._config.backoff_s * 2 ** (attempt - 1), self._config.max_backoff_s)
        return pause * random.uniform(0.5, 1.0)

    def _failure(self, doing: str, pool: str, name: str, exc: Exception) -> ScaleError:
        where = f"deployment {self._config.namespace}/{name} (pool {pool!r})"
        status = getattr(exc, "status", None) if isinstance(exc, self._api_error) else None
        if status is None:
            return ScaleError(f"{doing} {where}: no answer from the API server: {exc}")
        reason = getattr(exc, "reason", None) or ""
        detail = _status_message(getattr(exc, "body", None))
        return ScaleError(
            f"{doing} {where}: HTTP {status} {reason}".rstrip() + (f": {detail}" if detail else ""),
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
