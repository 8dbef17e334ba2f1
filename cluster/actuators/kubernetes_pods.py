"""Which pod a Deployment's scale-in removes: the one the planner chose, through the
``controller.kubernetes.io/pod-deletion-cost`` annotation.

When a Deployment's replicas drop, its ReplicaSet controller deletes pods that are not
scheduled, not running or not ready first, then those of lowest deletion cost (absent: 0),
then by node spread and age. The Kubernetes actuator therefore gives the workers to remove
(pods named by their worker ids: the chart starts each worker with
``--worker-id=$(POD_NAME)``) negative costs, the cheapest the lowest, and takes the annotation
off every other pod of the Deployment, before it lowers the replicas. It owns that annotation
on its workloads' pods.

It only sees the pods of its own two workloads: the list call carries the Deployment's
selector (the scale subresource's ``status.selector``), and pods whose labels do not match
it are dropped again here, so a pod of anything else is never patched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"

# One term of an equality-based label selector: key=value (or key==value).
_EQUALITY_TERM = re.compile(r"^\s*([A-Za-z0-9][-A-Za-z0-9_./]*)\s*==?\s*([-A-Za-z0-9_.]*)\s*$")


def selector_labels(selector: str | None) -> dict[str, str] | None:
    """The labels an equality-based selector (``"a=b,c=d"``: how a Deployment's scale
    reports its ``matchLabels``) requires; None when there is none or it has other terms
    (set-based, ``!=``), which this module does not check."""
    if not selector:
        return None
    labels = {}
    for term in selector.split(","):
        match = _EQUALITY_TERM.match(term)
        if match is None:
            return None
        labels[match.group(1)] = match.group(2)
    return labels


@dataclass(slots=True, frozen=True)
class PodView:
    """A pod as the choice needs it: its name and its deletion cost annotation (or None)."""

    name: str
    deletion_cost: str | None = None


def deletion_cost_patches(pods: Sequence[PodView], remove: Sequence[str]) -> dict[str, str | None]:
    """Pod name -> new annotation value (None: take it off), only where it must change:
    the pods in ``remove`` (cheapest first) get -len(remove) ... -1, every other pod none."""
    cost = {name: str(rank - len(remove)) for rank, name in enumerate(remove)}
    return {pod.name: cost.get(pod.name) for pod in pods if pod.deletion_cost != cost.get(pod.name)}


class WorkloadPods:
    """The pods of one namespace that match a selector, and their deletion cost
    (``kubernetes.client.CoreV1Api`` calls: list and patch; client errors propagate)."""

    def __init__(self, core_api: Any, namespace: str, request_timeout_s: float) -> None:
        self._core = core_api
        self._namespace = namespace
        self._timeout_s = request_timeout_s

    def matching(self, labels: Mapping[str, str]) -> list[PodView]:
        """Pods carrying every label of ``labels`` and not being deleted, by name."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        listed = self._core.list_namespaced_pod(
            self._namespace, label_selector=selector, _request_timeout=self._timeout_s
        )
        pods = []
        for pod in listed.items:
            meta = pod.metadata
            own = meta.labels or {}
            if meta.deletion_timestamp is not None or any(
                own.get(k) != v for k, v in labels.items()
            ):
                continue
            pods.append(PodView(meta.name, (meta.annotations or {}).get(DELETION_COST)))
        return sorted(pods, key=lambda p: p.name)

    def set_deletion_cost(self, pod_name: str, cost: str | None) -> None:
        """Set (or, with None, take off) one pod's deletion cost: a merge patch of that
        annotation alone."""
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        self._core.patch_namespaced_pod(
            pod_name,
            self._namespace,
            body,
            _content_type=MERGE_PATCH,
            _request_timeout=self._timeout_s,
        )
