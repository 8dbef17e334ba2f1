"""`pdserve planner` as a process over a real Redis: it reads the routers' load, the registry
and the stored profile, and scales the decode Deployment through the real Kubernetes client
(against tests/integration/fake_kube_api.py, a fake API server: no real one can run here),
or only exports its decision as metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint
from pdserve.cluster.redis_server import RedisServer, free_loopback_port
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole
from pdserve.router.observe.goodput import RequestSample, SloConfig, goodput_figures
from pdserve.router.observe.goodput_store import GoodputStore
from tests.integration.fake_kube_api import FakeKubeApi

NS, PREFILL, DECODE = "serving", "pd-prefill", "pd-decode"
# One decode worker makes 200 output tokens/s within the ITL target.
PROFILE = CapacityProfile(2000.0, (DecodePoint(1, 50.0, 0.02), DecodePoint(8, 200.0, 0.05)), 8, 5)


def _publish_cluster(client: redis.Redis, keys: RedisKeys) -> None:
    """Two ready workers, a stored profile, and a router that served 4 requests/s of 100
    prompt and 100 output tokens: 400 output tokens/s, which need 3 decode workers."""
    registry = WorkerRegistry(client, keys, lease_s=60)
    for worker_id, role in (("prefill-0", WorkerRole.PREFILL), ("decode-0", WorkerRole.DECODE)):
        info = WorkerInfo(worker_id, role, "127.0.0.1:1", "m", 64, 16, registry.allocate_epoch())
        assert registry.register(info)
        registry.heartbeat(worker_id, info.epoch, WorkerLoad(running=4, free_blocks=32))
    document = {"model": "m", "dtype": "float32", "profile": PROFILE.to_dict()}
    client.set(keys.capacity_profile, json.dumps(document))
    slo = SloConfig(redis_prefix=keys.prefix, windows_s=(10.0,), publish_interval_s=60.0)
    # Latencies as the profile predicts them (prefill of 100 tokens 0.05 s; ITL at the decode
    # worker's batch of 4, between the measured points): the latency correction stays 1.
    itl_s = PROFILE.itl_s_at(4)
    samples = [RequestSample(t / 4, 0.05, itl_s, False, 100, 100) for t in range(1, 41)]
    assert GoodputStore(client, slo, "router-0").publish(
        [goodput_figures(samples, slo, 10.0, 10.0)]
    )


@pytest.fixture()
def cluster(redis_server: RedisServer, redis_client: redis.Redis, keys: RedisKeys) -> RedisKeys:
    _publish_cluster(redis_client, keys)
    return keys


def _planner(
    redis_url: str, keys: RedisKeys, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "pdserve.cluster.cli",
        "planner",
        "--redis-url",
        redis_url,
        "--key-prefix",
        keys.prefix,
        "--interval-s",
        "0.2",
        "--max-decode",
        "5",
        *args,
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )


@pytest.fixture()
def stop_after() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _wait(condition: object, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"planner exited {proc.returncode}:\n{out[-3000:]}")
        assert time.monotonic() < deadline_s, "planner did not decide in time"
        time.sleep(0.1)


def test_planner_scales_the_decode_deployment_through_kubernetes(
    redis_server: RedisServer, cluster: RedisKeys, stop_after: list[subprocess.Popen[bytes]]
) -> None:
    with FakeKubeApi({(NS, PREFILL): 1, (NS, DECODE): 1, (NS, "other"): 4}) as api:
        proc = _planner(redis_server.url, cluster, "--apply", "kubernetes", "--namespace", NS,
                        "--prefill-deployment", PREFILL, "--decode-deployment", DECODE,
                        "--kubernetes-host", api.url, "--metrics-port", "-1")  # fmt: skip
        stop_after.append(proc)
        _wait(lambda: api.replicas(NS, DECODE) == 3, 60, proc)
        time.sleep(1.0)  # the starting replicas count as capacity: no further order
        assert api.replicas(NS, DECODE) == 3
        assert api.replicas(NS, PREFILL) == 1 and api.replicas(NS, "other") == 4
        paths = {r.path for r in api.requests}
        assert paths <= {f"/apis/apps/v1/namespaces/{NS}/deployments/{d}/scale"
                         for d in (PREFILL, DECODE)}  # fmt: skip


def test_planner_scale_in_drains_and_removes_the_pods_it_chose(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    keys: RedisKeys,
    stop_after: list[subprocess.Popen[bytes]],
) -> None:
    # Three decode workers, each the pod of its name; 0.5 requests/s fit one. The planner
    # removes one at a time, the idlest first (no cached blocks anywhere): decode-b (idle,
    # drained at once), then decode-c (1 request that never finishes: the drain times out).
    registry = WorkerRegistry(redis_client, keys, lease_s=60)
    busy = {"pd-prefill-a": 0, "pd-decode-a": 3, "pd-decode-b": 0, "pd-decode-c": 1}
    for worker_id, running in busy.items():
        role = WorkerRole.PREFILL if "prefill" in worker_id else WorkerRole.DECODE
        info = WorkerInfo(worker_id, role, "127.0.0.1:1", "m", 64, 16, registry.allocate_epoch())
        assert registry.register(info)
        registry.heartbeat(worker_id, info.epoch, WorkerLoad(running=running, free_blocks=32))
    document = {"model": "m", "dtype": "float32", "profile": PROFILE.to_dict()}
    redis_client.set(keys.capacity_profile, json.dumps(document))
    slo = SloConfig(redis_prefix=keys.prefix, windows_s=(10.0,), publish_interval_s=60.0)
    samples = [RequestSample(2.0 * t, 0.05, PROFILE.itl_s_at(1), False, 100, 100)
               for t in range(1, 6)]  # fmt: skip
    assert GoodputStore(redis_client, slo, "router-0").publish(
        [goodput_figures(samples, slo, 10.0, 10.0)]
    )
    with FakeKubeApi() as api:
        api.add_deployment(NS, PREFILL, 1)
        api.add_deployment(NS, DECODE, 3)
        for worker_id in busy:
            api.add_pod(NS, worker_id, {"app": PREFILL if "prefill" in worker_id else DECODE})
        api.add_pod(NS, "unrelated", {"app": "other"})
        proc = _planner(redis_server.url, keys, "--apply", "kubernetes", "--namespace", NS,
                        "--prefill-deployment", PREFILL, "--decode-deployment", DECODE,
                        "--kubernetes-host", api.url, "--metrics-port", "-1",
                        "--scale-down-after-s", "0", "--scale-down-cooldown-s", "0",
                        env={"PDSERVE_DRAIN_TIMEOUT_S": "1"})  # fmt: skip
        stop_after.append(proc)
        _wait(lambda: api.replicas(NS, DECODE) == 1, 90, proc)
        assert api.deleted_pods == [(NS, "pd-decode-b"), (NS, "pd-decode-c")]
        assert api.pod_names(NS) == ["pd-decode-a", "pd-prefill-a", "unrelated"]
        assert api.replicas(NS, PREFILL) == 1
        # Each pod was marked after its worker left the routers' list, before its scale-in.
        marks = [(r.path.rsplit("/", 1)[1], r.body["metadata"]["annotations"])
                 for r in api.requests if r.method == "PATCH"]  # fmt: skip
        cost = "controller.kubernetes.io/pod-deletion-cost"
        assert marks == [("pd-decode-b", {cost: "-1"}), ("pd-decode-c", {cost: "-1"})]
        writes = [r.path.rsplit("/", 1)[1] if r.method == "PATCH" else r.body["spec"]["replicas"]
                  for r in api.requests if r.method in ("PATCH", "PUT")]  # fmt: skip
        assert writes == ["pd-decode-b", 2, "pd-decode-c", 1]
        assert all(r.query.get("labelSelector") == f"app={DECODE}"
                   for r in api.requests if r.path.endswith("/pods"))  # fmt: skip
    assert [w.worker_id for w in registry.list_workers()] == ["pd-decode-a", "pd-prefill-a"]


@pytest.mark.parametrize(("utilization", "decode"), [(None, 3), ("1.0", 2)])
def test_planner_exports_its_decision_for_hpa_or_keda(
    redis_server: RedisServer,
    cluster: RedisKeys,
    stop_after: list[subprocess.Popen[bytes]],
    utilization: str | None,
    decode: int,
) -> None:
    # 400 output tokens/s at 200 per replica: 3 replicas at the default target utilization
    # 0.8, 2 at 1.0.
    port = free_loopback_port()
    operating_point = ("--target-utilization", utilization) if utilization else ()
    proc = _planner(redis_server.url, cluster, "--apply", "metrics", "--host", "127.0.0.1",
                    "--metrics-port", str(port), *operating_point)  # fmt: skip
    stop_after.append(proc)

    def desired_decode() -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1.0).text
        except httpx.HTTPError:
            return False
        return f'pdserve_planner_desired_replicas{{pool="decode"}} {decode}.0' in text

    _wait(desired_decode, 60, proc)


def test_planner_without_a_profile_says_how_to_make_one(
    redis_server: RedisServer, keys: RedisKeys
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "planner", "--redis-url", redis_server.url,
         "--key-prefix", keys.prefix, "--apply", "metrics"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "run `pdserve profile --redis-url URL` once" in done.stderr
