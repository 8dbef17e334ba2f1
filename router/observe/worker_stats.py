"""The workers' own figures (``GetStats``), fetched on demand for /metrics and /dashboard.

Workers report counters since *they* started (prefix-hit tokens, transfer bytes, ...). The
router turns them into counters since *it* started that never go down: each fetch adds the
increase since the previous one, and a worker that restarted (new epoch, or a counter that
went down) contributes its whole new value. Workers that left keep their totals, so sums
over workers stay monotonic as the pools scale in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import grpc

from pdserve.proto import worker_pb2
from pdserve.proto.workers import WorkerInfo
from pdserve.router.state.directory import ChannelPool, WorkerDirectory

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerCounters:
    """Monotonic per-worker counts as ``GetStats`` reports them."""

    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    transfer_bytes: int = 0  # sent + received (a worker has one role)
    transfers_ok: int = 0
    transfers_failed: int = 0
    recompute_fallbacks: int = 0

    def plus(self, other: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))

    def minus(self, other: WorkerCounters) -> WorkerCounters | None:
        """``self - other`` field by field; None when a field went down (a reset)."""
        diffs = [a - b for a, b in zip(_values(self), _values(other), strict=True)]
        return None if min(diffs) < 0 else WorkerCounters(*diffs)


def _values(counters: WorkerCounters) -> tuple[int, ...]:
    return tuple(getattr(counters, f.name) for f in fields(counters))


@dataclass(slots=True, frozen=True)
class WorkerSnapshot:
    """One worker's answer to ``GetStats``; id and role come from the directory."""

    worker_id: str
    role: str
    epoch: int
    waiting: int
    running: int
    free_blocks: int
    cached_blocks: int
    total_blocks: int
    counters: WorkerCounters

    @property
    def kv_usage(self) -> float | None:
        """Fraction of KV blocks in use (free blocks that still cache a prefix are free)."""
        if self.total_blocks <= 0:
            return None
        return (self.total_blocks - self.free_blocks) / self.total_blocks


def snapshot_from_proto(info: WorkerInfo, stats: worker_pb2.WorkerStats) -> WorkerSnapshot:
    counters = WorkerCounters(
        prefix_hit_tokens=stats.prefix_hit_tokens,
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        transfer_bytes=stats.transfer_bytes,
        transfers_ok=stats.transfers_ok,
        transfers_failed=stats.transfers_failed,
        recompute_fallbacks=stats.recompute_fallbacks,
    )
    return WorkerSnapshot(
        worker_id=info.worker_id,
        role=info.role.value,
        epoch=stats.epoch,
        waiting=stats.waiting,
        running=stats.running,
        free_blocks=stats.free_blocks,
        cached_blocks=stats.cached_blocks,
        total_blocks=stats.total_blocks,
        counters=counters,
    )


def counter_increase(previous: WorkerSnapshot | None, current: WorkerSnapshot) -> WorkerCounters:
    """What ``current`` adds to the router's totals (pure; see the module docstring)."""
    if previous is None or previous.epoch != current.epoch:
        return current.counters
    increase = current.counters.minus(previous.counters)
    return current.counters if increase is None else increase


@dataclass(slots=True, frozen=True)
class WorkerTotals:
    """A worker's counters accumulated since the router started."""

    worker_id: str
    role: str
    counters: WorkerCounters


class WorkerStatsPoller:
    """Calls ``GetStats`` on every live worker, at most once per ``min_interval_s``."""

    def __init__(
        self,
        directory: WorkerDirectory,
        channels: ChannelPool,
        timeout_s: float = 1.0,
        min_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.channels = channels
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_refresh_s: float | None = None
        self._lock = asyncio.Lock()
        self._latest: dict[str, WorkerSnapshot] = {}
        self._answered: set[str] = set()  # live workers that answered the last refresh
        self._totals: dict[str, WorkerTotals] = {}
        self._failing: set[str] = set()

    async def refresh(self) -> None:
        """Fetch every live worker's stats unless a refresh ran within ``min_interval_s``."""
        async with self._lock:  # concurrent scrapes share one round of calls
            last_s = self._last_refresh_s
            if last_s is not None and self._clock() - last_s < self.min_interval_s:
                return
            workers = list(self.directory.live_workers())
            answers = await asyncio.gather(*(self._fetch(w) for w in workers))
            self._answered = set()
            for info, stats in zip(workers, answers, strict=True):
                if stats is not None:
                    self._apply(snapshot_from_proto(info, stats))
            self._last_refresh_s = self._clock()

    def live(self) -> list[WorkerSnapshot]:
        """The latest snapshot of each live worker that answered the last refresh."""
        ids = [w.worker_id for w in self.directory.live_workers()]
        return [self._latest[i] for i in ids if i in self._answered]

    def up(self) -> dict[str, bool]:
        """Live worker id -> whether it answered the last refresh."""
        return {w.worker_id: w.worker_id in self._answered for w in self.directory.live_workers()}

    def totals(self) -> list[WorkerTotals]:
        """Accumulated counters of every worker seen since the router started."""
        return list(self._totals.values())

    def _apply(self, snapshot: WorkerSnapshot) -> None:
        wid = snapshot.worker_id
        increase = counter_increase(self._latest.get(wid), snapshot)
        before = self._totals.get(wid)
        base = before.counters if before is not None else WorkerCounters()
        self._totals[wid] = WorkerTotals(wid, snapshot.role, base.plus(increase))
        self._latest[wid] = snapshot
        self._answered.add(wid)

    async def _fetch(self, info: WorkerInfo) -> worker_pb2.WorkerStats | None:
        try:
            stats = await self.channels.stub(info.address).GetStats(
                worker_pb2.StatsRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as err:
            if info.worker_id not in self._failing:  # once per outage, not per scrape
                self._failing.add(info.worker_id)
                log.warning(
                    "GetStats on worker %s (%s) failed: %s %s",
                    info.worker_id,
                    info.address,
                    err.code().name,
                    err.details(),
                )
            return None
        if info.worker_id in self._failing:
            self._failing.discard(info.worker_id)
            log.warning("GetStats on worker %s answers again", info.worker_id)
        return stats
