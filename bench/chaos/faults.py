"""The faults, one at a time, each struck while the steady load runs.

A fault waits for its moment (a stream mid-way on the worker it kills, a first token that
just arrived so the KV transfer is under way), strikes, and returns when it has done its
part (a frozen worker is resumed after ``FREEZE_S``); the cluster recovers by itself.
Faults on links need a worker host with its own network: they run only on the multi-host
cluster and are reported as not run here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.bench.chaos.cluster import ChaosCluster
from pdserve.bench.chaos.load import SteadyLoad

FREEZE_S = 10.0
MOMENT_TIMEOUT_S = 60.0

Strike = Callable[[ChaosCluster, SteadyLoad], Awaitable[str]]


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    strike: Strike | None  # None: needs hosts with their own network


async def _moment(find: Callable[[], str | None], what: str) -> str:
    """Poll ``find`` until it names a target."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while (target := find()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no moment for the fault in {MOMENT_TIMEOUT_S} s: {what}")
        await asyncio.sleep(0.01)
    return target


async def kill_decode_mid_stream(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pids = cluster.worker_pids()

    def streaming() -> str | None:
        for key, (_prefill, decode) in load.in_flight.workers.items():
            if decode in pids and key in load.in_flight.first_token:
                return decode
        return None

    worker = await _moment(streaming, "a stream on a decode worker")
    os.kill(pids[worker], signal.SIGKILL)
    return worker


async def kill_prefill_mid_transfer(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pids = cluster.worker_pids()

    def transferring() -> str | None:
        now = time.monotonic()
        for key, first in list(load.in_flight.first_token.items()):
            prefill = load.in_flight.workers.get(key, ("", ""))[0]
            if prefill in pids and now - first < 0.05:  # its KV is on the way
                return prefill
        return None

    worker = await _moment(transferring, "a first token that just arrived")
    os.kill(pids[worker], signal.SIGKILL)
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
    pids = cluster.worker_pids()
    worker = await _moment(
        lambda: next((d for _p, d in load.in_flight.workers.values() if d in pids), None),
        "a decode worker with a stream",
    )
    os.kill(pids[worker], signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)
    finally:
        os.kill(pids[worker], signal.SIGCONT)
    return worker


FAULTS = (
    Fault("decode-kill", "kill -9 of a decode worker mid-stream", kill_decode_mid_stream),
    Fault("prefill-kill", "kill -9 of a prefill worker mid-transfer", kill_prefill_mid_transfer),
    Fault("router-kill", "kill -9 of one of two routers (clients retry)", kill_one_router),
    Fault("redis-restart", "Redis killed, restarted empty", restart_redis_empty),
    Fault("freeze", f"a decode worker frozen (SIGSTOP) {FREEZE_S:.0f} s", freeze_decode_worker),
    Fault("link-cut", "a worker host's link cut for 10 s", None),
    Fault("slow-link", "a link at 100 Mbit/s, 5% loss, 30 s", None),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
