"""The faults, one at a time, each struck while the steady load runs.

A fault waits for its moment (asking the workers' ``GetStats`` every few milliseconds: a
decode worker streaming, a prefill worker computing a prompt or sending its KV), strikes,
and returns when it has done its part (a frozen worker is resumed after ``FREEZE_S``, a link
restored after its spell); the cluster recovers by itself. Faults on links
(``needs_hosts``) strike the worker host of a streaming decode worker, on the cluster of
hosts with their own network (``cluster.on_hosts``): its link cut (``ip link set down``),
or slowed by a token bucket and made lossy by ``iptables`` rules that drop a random share
of its packets.
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
from pdserve.bench.netns_hosts import Host
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.workers import WorkerInfo, WorkerRole

FREEZE_S = 10.0
BURST_S = 20.0
LINK_CUT_S = 10.0
SLOW_LINK_S = 30.0
SLOW_LINK_RATE = "100mbit"
SLOW_LINK_DROP_SHARE = 0.05
LINK_COMMANDS = ("ip", "tc", "iptables")  # what the faults on links run
MOMENT_TIMEOUT_S = 60.0

Strike = Callable[[ChaosCluster, SteadyLoad], Awaitable[str]]


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    strike: Strike
    needs_hosts: bool = False  # strikes a worker host's own network (cluster.on_hosts)


async def _busy(
    cluster: ChaosCluster, role: WorkerRole, is_busy: Callable[[worker_pb2.WorkerStats], bool]
) -> WorkerInfo:
    """A worker of ``role`` whose counters say ``is_busy`` now, polled."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    workers = cluster.workers(role)
    channels = [cluster.worker_channel(w.address) for w in workers]
    try:
        stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
        while time.monotonic() < deadline:
            for w, stub in zip(workers, stubs, strict=True):
                stats = await worker_stats(stub)
                if stats is not None and is_busy(stats):
                    return w
            await asyncio.sleep(0.005)
    finally:
        for c in channels:
            await c.close()
    raise TimeoutError(f"no {role.value} worker was busy for {MOMENT_TIMEOUT_S} s")


def _streaming(stats: worker_pb2.WorkerStats) -> bool:
    return stats.running > 0


async def kill_decode_mid_stream(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker = await _busy(cluster, WorkerRole.DECODE, _streaming)
    os.kill(pid_of(worker), signal.SIGKILL)
    return worker.worker_id


def _prefilling(stats: worker_pb2.WorkerStats) -> bool:
    """Computing a prompt or sending its KV. A transfer alone is open for milliseconds on an
    idle machine (a 512-token prompt's KV crosses loopback in ~15 ms), too short to catch by
    polling; a prompt's computation, which every transfer follows, lasts 0.1-0.6 s."""
    return stats.running > 0 or stats.transfers_in_flight > 0


async def kill_busy_prefill(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker = await _busy(cluster, WorkerRole.PREFILL, _prefilling)
    os.kill(pid_of(worker), signal.SIGKILL)
    return worker.worker_id


async def kill_one_router(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pid = cluster.spare_router_pids()[0]
    os.kill(pid, signal.SIGKILL)
    return f"router process {pid}"


async def restart_redis_empty(cluster: ChaosCluster, load: SteadyLoad) -> str:
    pid = cluster.redis_pid()
    os.kill(pid, signal.SIGKILL)  # `pdserve up` starts it again, empty
    return f"redis-server {pid}"


async def freeze_decode_worker(cluster: ChaosCluster, load: SteadyLoad) -> str:
    worker = await _busy(cluster, WorkerRole.DECODE, _streaming)
    pid = pid_of(worker)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    return worker.worker_id


def overload(rate: float) -> Fault:
    """A burst of ``rate`` requests/s for ``BURST_S``, on top of the steady load."""

    async def strike(cluster: ChaosCluster, load: SteadyLoad) -> str:
        live = sum(len(cluster.workers(role)) for role in WorkerRole)
        burst = load.burst(rate)
        running = asyncio.create_task(burst.run())
        await asyncio.sleep(BURST_S)
        await burst.drain()
        await running
        after = sum(len(cluster.workers(role)) for role in WorkerRole)
        return f"{BURST_S:.0f} s at {burst.rate:g} req/s; workers registered: {live}, then {after}"

    return Fault("overload", f"a burst at {rate:g} req/s for {BURST_S:.0f} s, on top", strike)


async def cut_a_worker_hosts_link(cluster: ChaosCluster, load: SteadyLoad) -> str:
    return await _spell_on_a_link(cluster, Host.cut_off, _reconnect, LINK_CUT_S)


async def slow_and_lossy_link(cluster: ChaosCluster, load: SteadyLoad) -> str:
    return await _spell_on_a_link(cluster, _degrade, _restore, SLOW_LINK_S)


async def _spell_on_a_link(
    cluster: ChaosCluster,
    harm: Callable[[Host], None],
    mend: Callable[[Host], str],
    spell_s: float,
) -> str:
    """``harm`` the link of a host whose decode worker streams, ``mend`` it ``spell_s``
    later (what it returns ends the description)."""
    worker = await _busy(cluster, WorkerRole.DECODE, _streaming)
    host = cluster.host_of(worker)
    await asyncio.to_thread(harm, host)
    try:
        await asyncio.sleep(spell_s)
    finally:
        note = await asyncio.to_thread(mend, host)
    return f"host {host.name}'s link ({worker.worker_id} was streaming){note}"


def _reconnect(host: Host) -> str:
    host.reconnect()
    return ""


def _degrade(host: Host) -> None:
    host.degrade_link(SLOW_LINK_RATE, SLOW_LINK_DROP_SHARE)


def _restore(host: Host) -> str:
    dropped = host.dropped_packets()
    host.restore_link()
    return f", {dropped} packets dropped"


FAULTS = (
    Fault("decode-kill", "kill -9 of a decode worker mid-stream", kill_decode_mid_stream),
    Fault("prefill-kill", "kill -9 of a busy prefill worker (prompt or KV)", kill_busy_prefill),
    Fault("router-kill", "kill -9 of one of two routers (clients retry)", kill_one_router),
    Fault("redis-restart", "Redis killed, restarted empty", restart_redis_empty),
    Fault("freeze", f"a decode worker frozen (SIGSTOP) {FREEZE_S:.0f} s", freeze_decode_worker),
    Fault(
        "link-cut",
        f"a worker host's link cut for {LINK_CUT_S:.0f} s",
        cut_a_worker_hosts_link,
        needs_hosts=True,
    ),
    Fault(
        "slow-link",
        f"a worker host's link at 100 Mbit/s, {SLOW_LINK_DROP_SHARE:.0%} loss, {SLOW_LINK_S:.0f} s",
        slow_and_lossy_link,
        needs_hosts=True,
    ),
)
FAULT_NAMES = (*(f.name for f in FAULTS), "overload")
