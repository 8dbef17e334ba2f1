"""The Kubernetes actuator through the real ``kubernetes`` client against a FAKE API server
(tests/integration/fake_kube_api.py: the real one cannot run here)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from pdserve.cluster.actuators import POOLS, Actuator
from pdserve.cluster.actuators.kubernetes import (
    KubernetesActuator,
    KubernetesActuatorConfig,
    ScaleConflictError,
    ScaleError,
    load_kubernetes,
)
from tests.integration.fake_kube_api import (
    DELETION_COST,
    FakeKubeApi,
    RecordedRequest,
    pod_path,
    pods_path,
    scale_path,
)

NS = "serving"
PREFILL = "pdserve-prefill"
DECODE = "pdserve-decode"
OWN_PATHS = {scale_path(NS, PREFILL), scale_path(NS, DECODE)}


@pytest.fixture()
def fake() -> Iterator[FakeKubeApi]:
    # Two more scale subresources the actuator must never touch: another app's Deployment in
    # the same namespace and a same-named Deployment in another namespace.
    deployments = {
        (NS, PREFILL): 1,
        (NS, DECODE): 2,
        (NS, "other-app"): 7,
        ("elsewhere", DECODE): 5,
    }
    with FakeKubeApi(deployments) as api:
        yield api


def _config(fake: FakeKubeApi, **overrides: object) -> KubernetesActuatorConfig:
    config = KubernetesActuatorConfig(
        namespace=NS,
        prefill_deployment=PREFILL,
        decode_deployment=DECODE,
        host=fake.url,
        backoff_s=0.001,
        max_backoff_s=0.01,
        request_timeout_s=5.0,
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


@pytest.fixture()
def actuator(fake: FakeKubeApi) -> Iterator[KubernetesActuator]:
    with KubernetesActuator.from_config(_config(fake)) as act:
        yield act


def _untouched(fake: FakeKubeApi) -> None:
    assert fake.replicas(NS, "other-app") == 7
    assert fake.replicas("elsewhere", DECODE) == 5
    assert {r.path for r in fake.requests} <= OWN_PATHS
    assert {r.method for r in fake.requests} <= {"GET", "PUT"}


def test_is_an_actuator(actuator: KubernetesActuator) -> None:
    assert isinstance(actuator, Actuator)
    assert POOLS == ("prefill", "decode")


def test_reads_replicas(fake: FakeKubeApi, actuator: KubernetesActuator) -> None:
    assert actuator.replicas("prefill") == 1
    assert actuator.replicas("decode") == 2
    fake.add_deployment(NS, PREFILL, 0)  # the API server omits spec.replicas when it is 0
    assert actuator.replicas("prefill") == 0
    assert [(r.method, r.path) for r in fake.requests] == [
        ("GET", scale_path(NS, PREFILL)),
        ("GET", scale_path(NS, DECODE)),
        ("GET", scale_path(NS, PREFILL)),
    ]
    _untouched(fake)


def test_scales_the_right_workload(
    fake: FakeKubeApi, actuator: KubernetesActuator, caplog: pytest.LogCaptureFixture
) -> None:
    version = fake.resource_version(NS, DECODE)
    with caplog.at_level(logging.INFO, logger="pdserve.autoscale.kubernetes"):
        actuator.scale("decode", 4)
    assert fake.replicas(NS, DECODE) == 4
    assert fake.replicas(NS, PREFILL) == 1
    assert actuator.replicas("decode") == 4

    get, put, _ = fake.requests
    assert (get.method, get.path) == ("GET", scale_path(NS, DECODE))
    assert (put.method, put.path, put.status) == ("PUT", scale_path(NS, DECODE), 200)
    # The write is preconditioned on what was read and names its field manager.
    assert put.body["metadata"]["resourceVersion"] == version
    assert put.body["spec"] == {"replicas": 4}
    assert put.query["fieldManager"] == "pdserve-autoscaler"
    assert "scaled pool decode (deployment serving/pdserve-decode): 2 -> 4 replicas" in caplog.text

    actuator.scale("prefill", 0)  # to zero is allowed
    assert fake.replicas(NS, PREFILL) == 0
    _untouched(fake)


def test_no_write_when_already_there(fake: FakeKubeApi, actuator: KubernetesActuator) -> None:
    actuator.scale("decode", 2)
    assert [r.method for r in fake.requests] == ["GET"]


def test_retries_on_conflict(fake: FakeKubeApi, actuator: KubernetesActuator) -> None:
    fake.fail_next_writes(2)
    actuator.scale("prefill", 3)
    assert fake.replicas(NS, PREFILL) == 3
    assert [(r.method, r.status) for r in fake.requests] == [
        ("GET", 200),
        ("PUT", 409),
        ("GET", 200),
        ("PUT", 409),
        ("GET", 200),
        ("PUT", 200),
    ]
    _untouched(fake)


def test_stale_read_is_a_real_conflict(fake: FakeKubeApi, actuator: KubernetesActuator) -> None:
    # Another writer changes the object between each read and write: the resourceVersion the
    # actuator sends is stale, the server refuses, the actuator reads the new one and wins.
    fake.race_next_writes(1)
    actuator.scale("decode", 6)
    assert fake.replicas(NS, DECODE) == 6
    puts = [r for r in fake.requests if r.method == "PUT"]
    assert [p.status for p in puts] == [409, 200]
    first, second = (p.body["metadata"]["resourceVersion"] for p in puts)
    assert first != second


def test_gives_up_after_bounded_attempts(fake: FakeKubeApi) -> None:
    fake.fail_next_writes(100)
    act = KubernetesActuator.from_config(_config(fake, max_attempts=3))
    with act, pytest.raises(ScaleConflictError) as err:
        act.scale("decode", 9)
    message = str(err.value)
    assert "gave up after 3 attempts" in message
    assert "409 Conflict" in message
    assert "serving/pdserve-decode" in message
    assert err.value.status == 409
    assert [r.method for r in fake.requests].count("PUT") == 3
    assert fake.replicas(NS, DECODE) == 2
    _untouched(fake)


def test_refuses_unknown_pools_and_bad_counts(
    fake: FakeKubeApi, actuator: KubernetesActuator
) -> None:
    for pool in ("colocated", "other-app", PREFILL, ""):
        with pytest.raises(ValueError, match=r"known pools: \['prefill', 'decode'\]"):
            actuator.scale(pool, 1)
        with pytest.raises(ValueError, match="known pools"):
            actuator.replicas(pool)
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        actuator.scale("decode", -1)
    with pytest.raises(TypeError):
        actuator.scale("decode", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        actuator.scale("decode", True)
    assert fake.requests == []  # refused before any request


def test_api_errors_name_the_workload(fake: FakeKubeApi) -> None:
    config = _config(fake, decode_deployment="missing")
    with KubernetesActuator.from_config(config) as act:
        with pytest.raises(ScaleError, match=r"serving/missing \(pool 'decode'\): HTTP 404") as err:
            act.scale("decode", 1)
        assert err.value.status == 404
        with pytest.raises(ScaleError, match="not found"):
            act.replicas("decode")


def test_unreachable_api_server(fake: FakeKubeApi) -> None:
    config = _config(fake, request_timeout_s=1.0)
    fake.stop()  # nothing listens on its port any more
    act = KubernetesActuator.from_config(config)
    with act, pytest.raises(ScaleError, match="no answer from the API server") as err:
        act.replicas("prefill")
    assert err.value.status is None


def test_kubeconfig(fake: FakeKubeApi, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{fake.url}"}}
users:
- name: autoscaler
  user: {{token: not-a-secret}}
contexts:
- name: fake
  context: {{cluster: fake, user: autoscaler, namespace: {NS}}}
current-context: fake
"""
    )
    config = _config(fake, host=None, kubeconfig=str(kubeconfig), context="fake")
    with KubernetesActuator.from_config(config) as act:
        act.scale("prefill", 2)
    assert fake.replicas(NS, PREFILL) == 2
    _untouched(fake)


def test_in_cluster_needs_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    config = KubernetesActuatorConfig(NS, PREFILL, DECODE)
    with pytest.raises(RuntimeError, match="set kubeconfig or host"):
        KubernetesActuator.from_config(config)


def test_config_checks() -> None:
    config = KubernetesActuatorConfig(NS, PREFILL, DECODE)
    assert config.deployments == {"prefill": PREFILL, "decode": DECODE}
    with pytest.raises(FrozenInstanceError):
        config.namespace = "x"  # type: ignore[misc]
    assert not hasattr(config, "__dict__")  # slotted
    for bad in (
        {"namespace": "Bad_NS"},
        {"prefill_deployment": "../secrets"},
        {"decode_deployment": ""},
        {"decode_deployment": PREFILL},
        {"host": "http://127.0.0.1:1", "kubeconfig": "/k"},
        {"context": "c"},
        {"max_attempts": 0},
        {"backoff_s": -1.0},
        {"request_timeout_s": 0.0},
    ):
        with pytest.raises(ValueError):
            replace(config, **bad)


def test_missing_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "kubernetes" or name.startswith("kubernetes."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ImportError, match=r"needs the 'kubernetes' package \(pip install"):
        load_kubernetes()


# -- scale-in: drain, mark the chosen pod, then lower the replicas ---------------------------

DECODE_PODS = ("pdserve-decode-a", "pdserve-decode-b", "pdserve-decode-c")


class _Drain:
    """A ``WorkerDrain`` that records its calls and how many API requests preceded each."""

    def __init__(self, fake: FakeKubeApi) -> None:
        self.fake = fake
        self.drained: list[tuple[tuple[str, ...], int]] = []
        self.released: list[tuple[str, ...]] = []

    def drain(self, worker_ids: Sequence[str]) -> dict[str, int]:
        self.drained.append((tuple(worker_ids), len(self.fake.requests)))
        return dict.fromkeys(worker_ids, 0)

    def release(self, worker_ids: Sequence[str]) -> None:
        self.released.append(tuple(worker_ids))


@pytest.fixture()
def pods(fake: FakeKubeApi) -> FakeKubeApi:
    """Three decode pods (the scale says 3), one prefill pod, and pods the actuator must
    never touch: another app's in the namespace (with its own deletion cost), and one with
    the decode pods' labels and a decode pod's name in another namespace."""
    fake.add_deployment(NS, DECODE, 3)
    for name in DECODE_PODS:
        fake.add_pod(NS, name, {"app": DECODE})
    fake.add_pod(NS, "pdserve-prefill-a", {"app": PREFILL})
    fake.add_pod(NS, "other-app-0", {"app": "other-app"}, {DELETION_COST: "-5"})
    fake.add_pod("elsewhere", "pdserve-decode-b", {"app": DECODE})
    fake.clear_requests()
    return fake


def _pod_requests(fake: FakeKubeApi) -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path.startswith("/api/v1/")]


def _only_own_objects(fake: FakeKubeApi) -> None:
    """Every request named one of the two scale subresources, the namespace's pod list with
    a workload's selector, or a decode pod; nothing else was read or written."""
    own = {pod_path(NS, p) for p in DECODE_PODS} | OWN_PATHS | {pods_path(NS)}
    assert {r.path for r in fake.requests} <= own
    for r in fake.requests:
        if r.path == pods_path(NS):
            assert (r.method, r.query["labelSelector"]) == ("GET", f"app={DECODE}")
        elif r.path.startswith("/api/v1/"):
            assert r.method == "PATCH"
    assert fake.pod_annotations(NS, "other-app-0") == {DELETION_COST: "-5"}
    assert "other-app-0" in fake.pod_names(NS)
    assert fake.pod_names("elsewhere") == ["pdserve-decode-b"]
    assert fake.pod_annotations("elsewhere", "pdserve-decode-b") == {}
    _untouched_scales(fake)


def _untouched_scales(fake: FakeKubeApi) -> None:
    assert fake.replicas(NS, "other-app") == 7
    assert fake.replicas("elsewhere", DECODE) == 5
    assert fake.replicas(NS, PREFILL) == 1


def test_scale_in_drains_marks_the_chosen_pod_then_scales(pods: FakeKubeApi) -> None:
    pods.add_pod(NS, "pdserve-decode-a", {"app": DECODE}, {DELETION_COST: "-1"})  # stale mark
    pods.clear_requests()
    drain = _Drain(pods)
    with KubernetesActuator.from_config(_config(pods), drain) as act:
        act.scale("decode", 2, remove=("pdserve-decode-b",))

    # The chosen worker was drained before any pod was written, its pod got the lowest
    # cost and the stale mark came off; only then did the replicas drop.
    assert drain.drained == [(("pdserve-decode-b",), 2)]  # after the scale read, the pod list
    writes = [(r.method, r.path, r.body) for r in pods.requests if r.method != "GET"]
    assert writes[:2] == [
        ("PATCH", pod_path(NS, "pdserve-decode-a"),
         {"metadata": {"annotations": {DELETION_COST: None}}}),
        ("PATCH", pod_path(NS, "pdserve-decode-b"),
         {"metadata": {"annotations": {DELETION_COST: "-1"}}}),
    ]  # fmt: skip
    (put,) = writes[2:]
    assert (put[0], put[1], put[2]["spec"]) == ("PUT", scale_path(NS, DECODE), {"replicas": 2})
    assert all(r.content_type == "application/merge-patch+json" for r in _pod_requests(pods)
               if r.method == "PATCH")  # fmt: skip
    # The controller stand-in removed the marked pod, the other two stay.
    assert pods.replicas(NS, DECODE) == 2
    assert pods.deleted_pods == [(NS, "pdserve-decode-b")]
    assert pods.pod_annotations(NS, "pdserve-decode-a") == {}
    assert drain.released == []
    _only_own_objects(pods)


def test_scale_in_never_touches_pods_outside_its_workload(pods: FakeKubeApi) -> None:
    # Asked to remove another app's pod and a decode pod, it drains and marks only its own;
    # the replicas drop by two and the controller picks the second pod.
    drain = _Drain(pods)
    with KubernetesActuator.from_config(_config(pods), drain) as act:
        act.scale("decode", 1, remove=("other-app-0", "pdserve-decode-c", "pdserve-decode-a"))
    assert drain.drained == [(("pdserve-decode-c",), 2)]
    assert [r.path for r in _pod_requests(pods) if r.method == "PATCH"] == [
        pod_path(NS, "pdserve-decode-c")
    ]
    assert pods.replicas(NS, DECODE) == 1
    assert pods.deleted_pods[0] == (NS, "pdserve-decode-c")
    assert len(pods.deleted_pods) == 2
    _only_own_objects(pods)


def test_scale_in_retries_on_conflict_without_marking_again(pods: FakeKubeApi) -> None:
    pods.race_next_writes(1)  # another writer changes the scale between read and write
    drain = _Drain(pods)
    with KubernetesActuator.from_config(_config(pods), drain) as act:
        act.scale("decode", 2, remove=("pdserve-decode-a",))
    assert [(r.method, r.status) for r in pods.requests if r.path == scale_path(NS, DECODE)] == [
        ("GET", 200),
        ("GET", 200),
        ("PUT", 409),
        ("GET", 200),
        ("PUT", 200),
    ]
    assert len(drain.drained) == 1
    assert len([r for r in _pod_requests(pods) if r.method == "PATCH"]) == 1
    assert pods.deleted_pods == [(NS, "pdserve-decode-a")]
    _only_own_objects(pods)


def test_a_failed_scale_in_gives_the_drained_worker_back(pods: FakeKubeApi) -> None:
    pods.fail_next_writes(100)
    drain = _Drain(pods)
    act = KubernetesActuator.from_config(_config(pods, max_attempts=2), drain)
    with act, pytest.raises(ScaleConflictError):
        act.scale("decode", 2, remove=("pdserve-decode-b",))
    assert drain.released == [("pdserve-decode-b",)]
    assert pods.replicas(NS, DECODE) == 3 and pods.deleted_pods == []


def test_scale_in_without_a_drain_still_picks_the_pod(pods: FakeKubeApi) -> None:
    with KubernetesActuator.from_config(_config(pods)) as act:
        act.scale("decode", 2, remove=("pdserve-decode-a",))
        act.scale("decode", 4, remove=("pdserve-decode-b",))  # a scale-up removes nothing
    assert pods.deleted_pods == [(NS, "pdserve-decode-a")]
    assert pods.replicas(NS, DECODE) == 4
    assert len([r for r in _pod_requests(pods) if r.method == "PATCH"]) == 1
    _only_own_objects(pods)
