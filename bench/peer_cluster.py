"""A small real cluster for the peer fetch benchmark: an embedded redis-server, two prefill
workers and one decode worker (``pdserve worker`` processes: each registers in Redis and
publishes its KV events), and routers over them run in this process, one at a time.

Workers get PR_SET_PDEATHSIG (they die with the benchmark) and SIGTERM, then SIGKILL, on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from pdserve.bench.up_process import terminate
from pdserve.cluster.redis_server import RedisServer, RedisServerConfig, connect
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.router_start import RedisRouterSpec, start_redis_router
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo
from pdserve.router.config import RouterConfig
from pdserve.router.edge.tokenizer import load_router_tokenizer
from pdserve.router.service import RouterService

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY_PREFIX = "peerbench:"
LEASE_S = 5.0
READY_TIMEOUT_S = 900.0
ROLES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}


@dataclass
class PeerCluster:
    redis_url: str
    model: str
    workers: dict[str, WorkerInfo]
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        channel = self.channels.get(worker_id)
        if channel is None:
            channel = self.channels[worker_id] = grpc.insecure_channel(
                self.workers[worker_id].address
            )
        return worker_pb2_grpc.WorkerStub(channel)

    def stats(self, worker_id: str) -> worker_pb2.WorkerStats:
        return self.stub(worker_id).GetStats(worker_pb2.StatsRequest(), timeout=30)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _launch(
    worker_id: str, role: str, redis_url: str, work_dir: Path, args: list[str]
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pdserve.cluster.cli", "worker", "--role", role]
    command += ["--worker-id", worker_id, "--redis-url", redis_url, "--key-prefix", KEY_PREFIX]
    command += args
    with (work_dir / f"{worker_id}.log").open("wb") as log_file:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_LEASE_S": str(LEASE_S)},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )


@contextlib.contextmanager
def running_cluster(
    work_dir: Path, model: str, worker_args: dict[str, list[str]]
) -> Iterator[PeerCluster]:
    """Redis and the three workers (``worker_args`` by role), registered and warm; all
    stopped on exit."""
    with RedisServer(RedisServerConfig()) as server:
        procs = {
            w: _launch(w, role, server.url, work_dir, worker_args[role])
            for w, role in ROLES.items()
        }
        try:
            cluster = PeerCluster(server.url, model, _registered(server.url, procs, work_dir))
            try:
                yield cluster
            finally:
                for channel in cluster.channels.values():
                    channel.close()
        finally:
            for proc in procs.values():
                terminate(proc, 30.0)


def _registered(
    redis_url: str, procs: dict[str, subprocess.Popen[bytes]], work_dir: Path
) -> dict[str, WorkerInfo]:
    """Wait until every worker is registered (loaded, warm); their registrations."""
    client = connect(redis_url)
    registry = WorkerRegistry(client, RedisKeys(KEY_PREFIX), LEASE_S)
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    try:
        while len(workers := {w.worker_id: w for w in registry.list_workers()}) < len(procs):
            dead = [w for w, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline_s:
                raise RuntimeError(f"workers {dead or list(procs)} did not start; see {work_dir}")
            time.sleep(0.5)
        return workers
    finally:
        client.close()


@contextlib.contextmanager
def running_router(cluster: PeerCluster, config: RouterConfig) -> Iterator[str]:
    """A router over the cluster's Redis (registry and locality index) on a loop in a
    thread; yields its gRPC address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-router", daemon=True)
    thread.start()
    spec = RedisRouterSpec(cluster.redis_url, KEY_PREFIX, LEASE_S, cluster.model)
    directory, locality = spec.sources(spec.client())
    config = replace(config, grpc_port=0, http_port=0)

    async def start() -> RouterService:
        tokenizer = await asyncio.to_thread(load_router_tokenizer, cluster.model)
        return await start_redis_router(spec, config, tokenizer, directory, locality)

    try:
        service = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
        try:
            yield f"127.0.0.1:{service.grpc_port}"
        finally:
            asyncio.run_coroutine_threadsafe(service.stop(None), loop).result(60)
    finally:
        directory.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
