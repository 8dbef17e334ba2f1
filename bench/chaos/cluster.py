"""The cluster under test: `pdserve up` as a child process, and the processes a fault hits.

Workers are found in the registry (their address, and the pid their heartbeat reports) and
asked what they hold right now with their ``GetStats`` RPC (over mutual TLS with the
cluster's secret, as the router calls them); router processes through the
cluster's state file (the first is `pdserve up` itself, which a fault must not kill: the
cluster would go); redis-server among `pdserve up`'s descendants.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from pdserve.bench.up_process import UpProcess, descendants
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.worker.cluster_secret import read_secret_file
from pdserve.worker.mutual_tls import client_tls

START_TIMEOUT_S = 900.0
ENV = {"PDSERVE_TORCH_THREADS": "1"}


@dataclass
class ChaosCluster:
    up: UpProcess

    @property
    def grpc_address(self) -> str:
        return self.up.grpc_address

    def workers(self, role: WorkerRole) -> list[WorkerInfo]:
        """The registered workers of ``role`` (none while Redis is away)."""
        client = redis.Redis.from_url(self.up.redis_url, socket_timeout=2.0)
        try:
            workers = WorkerRegistry(client, RedisKeys(self.up.state["key_prefix"])).list_workers()
        except redis.RedisError:
            return []
        finally:
            client.close()
        return [w for w in workers if w.role is role]

    def worker_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a worker's gRPC service, authenticated as the router's are."""
        secret_file = self.up.state.get("secret_file")
        if secret_file is None:
            return grpc.aio.insecure_channel(address)
        tls = client_tls(read_secret_file(Path(secret_file)))
        return grpc.aio.secure_channel(address, tls.credentials, options=tls.options)

    def spare_router_pids(self) -> list[int]:
        """The router processes other than `pdserve up` itself."""
        return [p for p in self.up.state["router_pids"] if p != self.up.process.pid]

    def redis_pid(self) -> int:
        (pid,) = [p for p, cmd in descendants(self.up.process.pid).items() if "redis-server" in cmd]
        return pid


def up_args(
    prefill: int, decode: int, routers: int, num_blocks: int, slo_ms: tuple[float, float]
) -> tuple[str, ...]:
    """`pdserve up`'s flags; the router gets the benchmark's SLO, and admission that follows
    it (its concurrency limit, and shedding past 3x the TTFT objective)."""
    return (
        "--prefill", str(prefill), "--decode", str(decode),
        "--router-processes", str(routers), "--num-blocks", str(num_blocks),
        "--slo-ttft-ms", str(slo_ms[0]), "--slo-tpot-ms", str(slo_ms[1]),
        "--adaptive-concurrency", "--shed-ttft-factor", "3",
    )  # fmt: skip


async def worker_stats(stub: worker_pb2_grpc.WorkerStub) -> worker_pb2.WorkerStats | None:
    """A worker's counters now, or None if it does not answer within a second."""
    try:
        stats: worker_pb2.WorkerStats = await stub.GetStats(worker_pb2.StatsRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return None
    return stats


def pid_of(worker: WorkerInfo) -> int:
    return int(dict(worker.load.extra)["pid"])
