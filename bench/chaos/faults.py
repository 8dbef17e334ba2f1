"""The faults, one at a time, each struck while the steady load runs.

A fault waits for its moment (asking the workers' ``GetStats`` every few milliseconds: a
decode worker streaming, a prefill worker computing a prompt or sending its KV), strikes,
and returns when it has done its part (a frozen worker is resumed after ``FREEZE_S``); the cluster
recovers by itself. Faults on links need a worker host with its own network: they run only
on the multi-host cluster and are reported as not run here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.bench.chaos.cluster import ChaosCluster, pid_of, worker_stats
from pdserve.bench.chaos.load import SteadyLoad
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.workers import WorkerRole

FREEZE_S = 10.0
BURST_FACTOR = 10.0
BURST_S = 20.0
MOMENT_TIMEOUT_S = 60.0

Strike = Callable[[ChaosCluster, SteadyLoad], Awaitable[str]]


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    strike: Strike | None  # None: needs hosts with their own network


async def _busy(
    cluster: ChaosCluster, role: WorkerRole, is_busy: Callable[[worker_pb2.WorkerStats], bool]
) -> tuple[str, int]:
    """A worker of ``role`` whose counters say ``is_busy`` now: (id, pid), polled."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    workers = cluster.workers(role)
    channels = [cluster.worker_channel(w.address) for w in workers]
    try:
        stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
        while time.monotonic() < deadline:
            for w, stub in zip(workers, stubs, strict=True):
                stats = await worker_stats(stub)
                if stats is not None and is_busy(stats):
                    return w.worker_id, pid_of(w)
            await asyncio.sleep(0.005)
    finally:
        for c in channels:
            await c.close()
    raise TimeoutError(f"no {role.value} worker was busy for {MOMENT_TIMEOUT_S} s")


def _streaming(stats: worker_pb2.WorkerStats) -> bool:
    return stats.running > 0


async def kill_decode_mid_stream(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker, pid = await _busy(cluster, WorkerRole.DECODE, _streaming)
    os.kill(pid, signal.SIGKILL)
    return worker


def _prefilling(stats: worker_pb2.WorkerStats) -> bool:
    """Computing a prompt or sending its KV. A transfer alone is open for milliseconds on an
    idle machine (a 512-token prompt's KV crosses loopback in ~15 ms), too short to catch by
    polling; a prompt's computation, which every transfer follows, lasts 0.1-0.6 s."""
    return stats.running > 0 or stats.transfers_in_flight > 0


async def kill_busy_prefill(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker, pid = await _busy(cluster, WorkerRole.PREFILL, _prefilling)
    os.kill(pid, signal.SIGKILL)
    return worker


async def kill_one_router(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pid = cluster.spare_router_pids()[0]
    os.kill(pid, signal.SIGKILL)
    return f"router process {pid}"


async def restart_redis_empty(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pid = cluster.redis_pid()
    os.kill(pid, signal.SIGKILL)  # `pdserve up` starts it again, empty
    return f"redis-server {pid}"


async def freeze_decode_worker(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker, pid = await _busy(cluster, WorkerRole.DECODE, _streaming)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    return worker


async def overload_burst(cluster: ChaosCluster, load: SteadyLoad) -> str:
    """A burst at ``BURST_FACTOR`` times the steady rate for ``BURST_S``, on top of it."""
    live = sum(len(cluster.workers(role)) for role in WorkerRole)
    burst = load.burst(BURST_FACTOR)
    running = asyncio.create_task(burst.run())
    await asyncio.sleep(BURST_S)
    await burst.drain()
    await running
    after = sum(len(cluster.workers(role)) for role in WorkerRole)
    return f"{BURST_S:.0f} s at {burst.rate:g} req/s; workers registered: {live}, then {after}"


FAULTS = (
    Fault("decode-kill", "kill -9 of a decode worker mid-stream", kill_decode_mid_stream),
    Fault("prefill-kill", "kill -9 of a busy prefill worker (prompt or KV)", kill_busy_prefill),
    Fault("router-kill", "kill -9 of one of two routers (clients retry)", kill_one_router),
    Fault("redis-restart", "Redis killed, restarted empty", restart_redis_empty),
    Fault("freeze", f"a decode worker frozen (SIGSTOP) {FREEZE_S:.0f} s", freeze_decode_worker),
    Fault(
        "overload", f"a burst at {BURST_FACTOR:.0f}x the rate for {BURST_S:.0f} s", overload_burst
    ),
    Fault("link-cut", "a worker host's link cut for 10 s", None),
    Fault("slow-link", "a link at 100 Mbit/s, 5% loss, 30 s", None),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
