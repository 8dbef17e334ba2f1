"""The Kubernetes actuator through the real ``kubernetes`` client against a FAKE API server
(tests/integration/fake_kube_api.py: the real one cannot run here)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
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
from tests.integration.fake_kube_api import FakeKubeApi, scale_path

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
