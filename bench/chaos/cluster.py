"""The cluster under test, and the processes and links a fault hits.

On one host: `pdserve up` as a child process. On hosts with their own network (for the
faults on links, ``on_hosts``): `pdserve up --head` (Redis, Ray, the router) on one, and
``WORKER_HOSTS`` that each `pdserve join` with a prefill and a decode worker, so that the
work of a host whose link fails has somewhere else to go.

Workers are found in the registry (their address, and the pid their heartbeat reports) and
asked what they hold right now with their ``GetStats`` RPC (over mutual TLS with the
cluster's secret, as the router calls them); router processes through the
cluster's state file (the first is `pdserve up` itself, which a fault must not kill: the
cluster would go); redis-server among `pdserve up`'s descendants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from pdserve.bench import netns_cluster
from pdserve.bench.netns_hosts import Host, lan
from pdserve.bench.up_process import UpProcess, descendants
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.worker.cluster_secret import read_secret_file
from pdserve.worker.mutual_tls import client_tls

START_TIMEOUT_S = 900.0
ENV = {"PDSERVE_TORCH_THREADS": "1"}
WORKER_HOSTS = ("w1", "w2")


@dataclass
class ChaosCluster:
    up: UpProcess  # `pdserve up`, or `pdserve up --head` on hosts
    hosts: Sequence[Host] = ()  # the worker hosts, when each has its own network

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

    def host_of(self, worker: WorkerInfo) -> Host:
        """The host ``worker`` runs on (by the address it registered)."""
        return host_at(self.hosts, worker.address)

    def redis_pid(self) -> int:
        (pid,) = [p for p, cmd in descendants(self.up.process.pid).items() if "redis-server" in cmd]
        return pid


def up_args(
    prefill: int,
    decode: int,
    routers: int,
    num_blocks: int,
    slo_ms: tuple[float, float],
    shed_factor: float = 3.0,
) -> tuple[str, ...]:
    """`pdserve up`'s flags; the router gets the benchmark's SLO, and admission that follows
    it (its concurrency limit, and shedding past ``shed_factor`` x the TTFT objective)."""
    return (
        "--prefill", str(prefill), "--decode", str(decode),
        "--router-processes", str(routers), "--num-blocks", str(num_blocks),
        "--slo-ttft-ms", str(slo_ms[0]), "--slo-tpot-ms", str(slo_ms[1]),
        "--adaptive-concurrency", "--shed-ttft-factor", str(shed_factor),
    )  # fmt: skip


def host_at(hosts: Sequence[Host], address: str) -> Host:
    """The host of ``hosts`` that ``address`` (IP:PORT) is on."""
    ip = address.rsplit(":", 1)[0]
    for host in hosts:
        if host.address == ip:
            return host
    raise LookupError(f"{address} is on none of the hosts {[h.address for h in hosts]}")


@contextlib.contextmanager
def on_hosts(directory: Path, up_flags: Sequence[str], num_blocks: int) -> Iterator[ChaosCluster]:
    """`pdserve up --head UP_FLAGS` and ``WORKER_HOSTS`` (one prefill and one decode worker
    each), serving for the ``with`` block; everything stopped and the hosts removed after."""
    workers = ("--prefill", "1", "--decode", "1", "--num-blocks", str(num_blocks))
    with lan(("head", *WORKER_HOSTS)) as net:
        head = netns_cluster.launch_head(net, directory, *up_flags)
        head.wait_serving(START_TIMEOUT_S)
        for name in WORKER_HOSTS:
            netns_cluster.join(net, directory, head.state, name, *workers)
        netns_cluster.joined(directory, WORKER_HOSTS)
        yield ChaosCluster(head, [net.hosts[name] for name in WORKER_HOSTS])


async def worker_stats(stub: worker_pb2_grpc.WorkerStub) -> worker_pb2.WorkerStats | None:
    """A worker's counters now, or None if it does not answer within a second."""
    try:
        stats: worker_pb2.WorkerStats = await stub.GetStats(worker_pb2.StatsRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return None
    return stats


def pid_of(worker: WorkerInfo) -> int:
    return int(dict(worker.load.extra)["pid"])
