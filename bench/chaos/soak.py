"""A long steady load, watched: does anything creep?

Every ``sample_s`` the soak reads, for each process of the cluster (`pdserve up` and its
descendants, named by what they are: a worker by its id, the router processes, redis-server,
Ray's daemons), its resident memory, open file descriptors and threads from ``/proc``, and
the number of keys in Redis. Growth is measured from the end of the warm-up (the first
``WARMUP_SHARE`` of the run, at least ``MIN_WARMUP_S``) to the end. When the load stops and
the last request is done, every worker's KV pool must be all free (cached prefixes count as
free: the next request may reuse or evict them) and Redis must hold only bounded state
(registry, locality index, goodput): the soak lists its keys by kind.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from pdserve.bench.chaos.cluster import ChaosCluster, worker_stats
from pdserve.bench.chaos.load import SteadyLoad
from pdserve.bench.up_process import descendants
from pdserve.proto import worker_pb2_grpc
from pdserve.proto.workers import WorkerInfo, WorkerRole

WARMUP_SHARE = 0.2
MIN_WARMUP_S = 60.0
RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py")


@dataclass(slots=True, frozen=True)
class ProcessSample:
    rss_mb: float
    fds: int
    threads: int


@dataclass(slots=True, frozen=True)
class Sample:
    at_s: float
    processes: dict[str, ProcessSample]  # name -> figures
    redis_keys: int
    registered_workers: int  # a worker missing here lost its lease (or died)


@dataclass(slots=True, frozen=True)
class Growth:
    name: str
    rss_warm_mb: float
    rss_end_mb: float
    fds_warm: int
    fds_end: int
    threads_warm: int
    threads_end: int

    @property
    def rss_growth(self) -> float:
        return self.rss_end_mb / self.rss_warm_mb - 1 if self.rss_warm_mb else 0.0


def growth(samples: Sequence[Sample], warmup_s: float) -> list[Growth]:
    """Per process alive at both ends: the first sample after ``warmup_s`` vs the last (pure)."""
    warm = next(s for s in samples if s.at_s >= warmup_s)
    end = samples[-1]
    rows = []
    for name in sorted(set(warm.processes) & set(end.processes)):
        a, b = warm.processes[name], end.processes[name]
        rows.append(Growth(name, a.rss_mb, b.rss_mb, a.fds, b.fds, a.threads, b.threads))
    return rows


def vanished(samples: Sequence[Sample], warmup_s: float) -> list[str]:
    """Processes followed at the end of the warm-up and not at the end (pure): a worker here
    died, or lost its registration, during the soak."""
    warm = next(s for s in samples if s.at_s >= warmup_s)
    return sorted(set(warm.processes) - set(samples[-1].processes))


def _proc_sample(pid: int) -> ProcessSample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None  # gone meanwhile
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return ProcessSample(rss_kb / 1024, fds, int(fields["Threads"]))


def _names(cluster: ChaosCluster, workers: Sequence[WorkerInfo]) -> dict[int, str]:
    """pid -> a stable name, for the processes worth following."""
    up = cluster.up
    names = {up.process.pid: "pdserve up (router 0)"}
    for i, pid in enumerate(cluster.spare_router_pids(), start=1):
        names[pid] = f"router {i}"
    for w in workers:
        names[int(dict(w.load.extra)["pid"])] = w.worker_id
    for pid, cmd in descendants(up.process.pid).items():
        if pid in names:
            continue
        if "redis-server" in cmd:
            names[pid] = "redis-server"
        else:
            daemon = next((d for d in RAY_DAEMONS if d in cmd), None)
            if daemon is not None:
                names[pid] = f"ray {daemon}"
    return names


def take_sample(cluster: ChaosCluster, start_s: float) -> Sample:
    workers = [w for role in WorkerRole for w in cluster.workers(role)]
    processes = {}
    for pid, name in _names(cluster, workers).items():
        figures = _proc_sample(pid)
        if figures is not None:
            processes[name] = figures
    client = redis.Redis.from_url(cluster.up.redis_url, socket_timeout=2.0)
    try:
        keys = int(client.dbsize())
    finally:
        client.close()
    return Sample(time.monotonic() - start_s, processes, keys, len(workers))


def redis_key_kinds(cluster: ChaosCluster) -> Counter[str]:
    """Keys by kind: the part of the name after the prefix, up to the next ':'."""
    prefix = cluster.up.state["key_prefix"]
    client = redis.Redis.from_url(cluster.up.redis_url, socket_timeout=2.0)
    try:
        kinds: Counter[str] = Counter()
        for key in client.scan_iter(count=1000):
            rest = key.decode(errors="replace").removeprefix(prefix)
            head, _, tail = rest.partition(":")
            kinds[f"{head}:{tail.split(':')[0]}" if head == "idx" else head] += 1
        return kinds
    finally:
        client.close()


async def kv_in_use(cluster: ChaosCluster) -> dict[str, int]:
    """Per worker, KV blocks not free (0 at idle)."""
    in_use = {}
    for role in WorkerRole:
        for w in cluster.workers(role):
            channel = cluster.worker_channel(w.address)
            try:
                stats = await worker_stats(worker_pb2_grpc.WorkerStub(channel))
            finally:
                await channel.close()
            if stats is not None:
                in_use[w.worker_id] = stats.total_blocks - stats.free_blocks
    return in_use


@dataclass(slots=True, frozen=True)
class SoakReport:
    minutes: float
    requests: int
    failed: dict[str, int]
    samples: list[Sample]
    growth: list[Growth]
    vanished: list[str]
    kv_in_use_at_idle: dict[str, int]
    redis_keys_at_idle: dict[str, int]
    inexact_streams: int = 0  # completed streams unlike their request's first one

    @property
    def clean(self) -> bool:
        return not any(self.kv_in_use_at_idle.values()) and self.inexact_streams == 0


async def soak(
    cluster: ChaosCluster, load: SteadyLoad, minutes: float, sample_s: float
) -> SoakReport:
    """Run ``load`` (already started) for ``minutes``, sampling; then stop it and look."""
    start = time.monotonic()
    end = start + minutes * 60
    samples = [take_sample(cluster, start)]
    while time.monotonic() < end:
        await asyncio.sleep(min(sample_s, max(0.0, end - time.monotonic())))
        samples.append(take_sample(cluster, start))
    await load.drain()
    await asyncio.sleep(2.0)  # the last releases reach the pools
    warmup_s = max(MIN_WARMUP_S, WARMUP_SHARE * minutes * 60)
    failed = Counter(o.status for o in load.outcomes if not o.ok)
    return SoakReport(
        minutes=minutes,
        requests=len(load.outcomes),
        failed=dict(failed),
        samples=samples,
        growth=growth(samples, min(warmup_s, samples[-1].at_s)),
        vanished=vanished(samples, min(warmup_s, samples[-1].at_s)),
        kv_in_use_at_idle=await kv_in_use(cluster),
        redis_keys_at_idle=dict(redis_key_kinds(cluster)),
    )


def print_soak(report: SoakReport) -> None:
    print(
        f"soak: {report.minutes:g} min, {report.requests} requests, "
        f"failed {report.failed or 0}; samples {len(report.samples)}"
    )
    print("| process | RSS after warm-up → end (MB) | RSS growth | open fds | threads |")
    print("|---|---|---|---|---|")
    for g in report.growth:
        print(
            f"| {g.name} | {g.rss_warm_mb:.0f} → {g.rss_end_mb:.0f} | {g.rss_growth:+.1%} "
            f"| {g.fds_warm} → {g.fds_end} | {g.threads_warm} → {g.threads_end} |"
        )
    print(f"followed after warm-up, gone at the end: {report.vanished or 'none'}")
    keys = [s.redis_keys for s in report.samples]
    print(f"Redis keys over time: {', '.join(map(str, keys))}")
    print(f"Redis keys at idle, by kind: {report.redis_keys_at_idle}")
    registered = [s.registered_workers for s in report.samples]
    print(f"registered workers over time: {', '.join(map(str, registered))}")
    print(f"KV blocks in use at idle: {report.kv_in_use_at_idle}")
    print(f"completed streams unlike their request's first: {report.inexact_streams}")
