"""The pure side of the Kubernetes actuator's scale-in choice: which selectors it can check,
which pods' deletion cost changes, and that a pod outside the selector is never returned
(``WorkloadPods`` over a stand-in for ``CoreV1Api``: no client library needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdserve.cluster.actuators.kubernetes_pods import (
    DELETION_COST,
    PodView,
    WorkloadPods,
    deletion_cost_patches,
    selector_labels,
)


def test_selector_labels_takes_key_value_terms_only() -> None:
    assert selector_labels("app.kubernetes.io/component=decode,app.kubernetes.io/instance=pd") == {
        "app.kubernetes.io/component": "decode",
        "app.kubernetes.io/instance": "pd",
    }
    assert selector_labels("a==b") == {"a": "b"}
    for other in (None, "", "a!=b", "a in (x,y)", "a", "!a"):
        assert selector_labels(other) is None


def test_victims_get_the_lowest_costs_and_other_pods_none() -> None:
    pods = [
        PodView("d-a", "-2"),  # marked by an earlier scale-in that did not happen
        PodView("d-b"),
        PodView("d-c"),
        PodView("d-d", "-1"),  # already as wanted: no patch
    ]
    assert deletion_cost_patches(pods, ("d-c", "d-d")) == {"d-a": None, "d-c": "-2"}
    assert deletion_cost_patches(pods, ()) == {"d-a": None, "d-d": None}
    assert deletion_cost_patches([PodView("d-b")], ("d-x",)) == {}


class _CoreApi:
    """Answers a list with every pod it holds, whatever the selector (a server that ignored
    it); records patches."""

    def __init__(self, pods: list[Any]) -> None:
        self.pods = pods
        self.patched: list[tuple[str, Any, str]] = []

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        assert kwargs["label_selector"] == "app=pd-decode,tier=workers"
        return SimpleNamespace(items=self.pods)

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kwargs: Any) -> None:
        self.patched.append((name, body, kwargs["_content_type"]))


def _pod(name: str, labels: dict[str, str], deleting: bool = False, **notes: str) -> Any:
    deleted_at = "2026-11-27T00:00:00Z" if deleting else None
    meta = SimpleNamespace(
        name=name, labels=labels, annotations=notes or None, deletion_timestamp=deleted_at
    )
    return SimpleNamespace(metadata=meta)


def test_workload_pods_keep_to_their_selector() -> None:
    own = {"app": "pd-decode", "tier": "workers"}
    core = _CoreApi([
        _pod("d-b", own),
        _pod("d-a", {**own, "extra": "x"}, **{DELETION_COST: "-1"}),
        _pod("other", {"app": "other", "tier": "workers"}),
        _pod("half", {"app": "pd-decode"}),
        _pod("d-gone", own, deleting=True),
    ])  # fmt: skip
    pods = WorkloadPods(core, "serving", 5.0)
    assert pods.matching({"tier": "workers", "app": "pd-decode"}) == [
        PodView("d-a", "-1"),
        PodView("d-b"),
    ]
    pods.set_deletion_cost("d-b", "-1")
    pods.set_deletion_cost("d-a", None)
    assert core.patched == [
        (
            "d-b",
            {"metadata": {"annotations": {DELETION_COST: "-1"}}},
            "application/merge-patch+json",
        ),
        (
            "d-a",
            {"metadata": {"annotations": {DELETION_COST: None}}},
            "application/merge-patch+json",
        ),
    ]
