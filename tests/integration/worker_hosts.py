"""Real workers served from the test process (worker/host.py's ``WorkerHost``).

Each is the real thing (engine with the default model, worker gRPC service on loopback, KV
connector), listed nowhere; unlike a worker process, its KV pool is in reach, so a test can
checksum the pool around a call and run a role's handlers on the worker's own event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.workers import WorkerInfo
from pdserve.worker.engine_callbacks import DrainFn, SnapshotFn, StatsFn
from pdserve.worker.host import HostedWorker, WorkerHost, WorkerSpec
from pdserve.worker.server import WorkerRoles
from tests.integration.fuzzing import block_checksums

T = TypeVar("T")
READY_TIMEOUT_S = 600.0


class _Unlisted:
    """The registration of a worker no router needs to find."""

    @property
    def epoch(self) -> int:
        return 1

    def stop(self, deregister: bool = True) -> None:
        """Nothing to withdraw."""


def _unlisted(info: WorkerInfo, stats: StatsFn, drain: DrainFn, snapshot: SnapshotFn) -> _Unlisted:
    return _Unlisted()


@dataclass
class InProcessWorker:
    host: WorkerHost
    hosted: HostedWorker
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.hosted.address)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    @property
    def roles(self) -> WorkerRoles:
        roles = self.host.roles
        assert roles is not None, "a hosted worker has its roles"
        return roles

    @property
    def pool(self) -> torch.Tensor:
        """The KV pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        pool: torch.Tensor = self.roles.engine.engine.runner.kv_cache
        return pool

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return self.host.run_on_loop(coro, timeout_s)

    def stats(self) -> worker_pb2.WorkerStats:
        return self.stub.GetStats(worker_pb2.StatsRequest(), timeout=30)

    def block_checksums(self) -> list[int]:
        """crc32 of each pool block (call while no request runs here)."""
        return block_checksums(self.pool)


@contextlib.contextmanager
def hosted_workers(specs: list[WorkerSpec]) -> Iterator[list[InProcessWorker]]:
    """Start every spec's worker (their models load side by side), stop them all on exit."""
    # transformers resolves its lazy attributes unsafely across threads: two workers
    # loading tokenizers at once can see "cannot import name 'AutoTokenizer'".
    from transformers import AutoTokenizer  # noqa: F401

    hosts = [WorkerHost(spec, _unlisted).start() for spec in specs]
    workers: list[InProcessWorker] = []
    try:
        for host in hosts:
            workers.append(InProcessWorker(host, host.wait_ready(READY_TIMEOUT_S)))
        yield workers
    finally:
        for worker in workers:
            worker.channel.close()
        for host in hosts:
            host.stop()
