"""`pdserve worker` and `pdserve router` as processes of their own over one real Redis (what
Kubernetes pods run): the worker registers once it serves, the router finds it there and
answers like the offline engine, and SIGTERM drains the worker out of the registry. Both
hold the cluster secret (PDSERVE_CLUSTER_SECRET_FILE): the router reaches the worker over
mutual TLS, a plaintext caller does not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.cluster.redis_server import RedisServer, free_loopback_port
from pdserve.cluster.registry import WorkerRegistry
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.redis_keys import RedisKeys
from pdserve.worker.cluster_secret import ClusterSecret, write_secret_file
from tests.integration.cluster_proc import wait_until
from tests.integration.worker_procs import offline_llm

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _spawn(log: Path, secret_file: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PDSERVE_TORCH_THREADS": "1"}
    env["PDSERVE_CLUSTER_SECRET_FILE"] = str(secret_file)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cluster.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


@pytest.fixture()
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_worker_and_router_commands_serve_over_redis(
    redis_server: RedisServer,
    redis_client: object,
    keys: RedisKeys,
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    common = ("--redis-url", redis_server.url, "--key-prefix", keys.prefix)
    secret = tmp_path / "cluster.secret"
    write_secret_file(secret, ClusterSecret.generate())
    worker = _spawn(tmp_path / "worker.log", secret, "worker", "--role", "colocated",
                    "--worker-id", "pod-w0", "--num-blocks", "128", "--metrics-port=-1",
                    *common)  # fmt: skip
    http_port, grpc_port = free_loopback_port(), free_loopback_port()
    router = _spawn(tmp_path / "router.log", secret, "router", "--host", "127.0.0.1",
                    "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                    *common)  # fmt: skip
    processes += [worker, router]
    registry = WorkerRegistry(redis_client, keys, lease_s=5.0)  # type: ignore[arg-type]
    wait_until(lambda: [w.worker_id for w in registry.list_workers()] == ["pod-w0"], 180,
               "the worker to register")  # fmt: skip
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}

    def router_sees_the_worker() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(router_sees_the_worker, 60, "the router to see the worker")
    reply = httpx.post(url, json=body, timeout=60).json()
    assert "choices" in reply, reply
    answer = reply["choices"][0]["text"]
    (reference,) = offline_llm().generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))
    assert answer == reference.text
    (address,) = [w.address for w in registry.list_workers()]
    with grpc.insecure_channel(address) as plaintext, pytest.raises(grpc.RpcError) as refused:
        worker_pb2_grpc.WorkerStub(plaintext).GetStats(worker_pb2.StatsRequest(), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE  # the TLS handshake failed

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert registry.list_workers() == [], "a drained worker deregisters"
    router.send_signal(signal.SIGTERM)
    assert router.wait(60) == 0, (tmp_path / "router.log").read_text()[-3000:]
