"""A worker's three callbacks for its registration agent (load, KV events drained, KV
snapshot), over an ``AsyncEngine``: engine calls hop to its thread.

The agent runs on its own thread; the engine is confined to the engine thread, so every
callback submits a function through ``AsyncEngine.run`` on the worker's event loop and waits
for it (bounded: a long step times out and the agent heartbeats with the last load).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pdserve.engine.kv_cache.events import CachedBlocks, KVCacheEvent
from pdserve.proto.workers import WorkerLoad

if TYPE_CHECKING:
    from pdserve.engine.async_engine import EngineStats

# What a worker offers whoever registers it (cluster/worker_agent.py), called from that
# party's thread.
StatsFn = Callable[[], WorkerLoad]
DrainFn = Callable[[], Sequence[KVCacheEvent]]
# Must drop the events not drained yet, atomically with reading the cache (the snapshot
# already contains their effect). Blocks in the tiers under the pool are included: a restarted
# worker's disk tier is in its first snapshot.
SnapshotFn = Callable[[], CachedBlocks]

T = TypeVar("T")


class EngineRunner(Protocol):
    """What we need of ``pdserve.engine.async_engine.AsyncEngine``."""

    async def run(self, fn: Callable[[Any], T]) -> T: ...

    async def stats(self) -> EngineStats: ...


def load_from_stats(stats: EngineStats, pid: int | None = None) -> WorkerLoad:
    """What a heartbeat carries, from an engine stats snapshot (pure)."""
    used = stats.total_blocks - stats.free_blocks
    usage = used / stats.total_blocks if stats.total_blocks else 0.0
    extra = {
        "kv_usage": round(usage, 4),
        "cached_blocks": float(stats.cached_blocks),
        "total_blocks": float(stats.total_blocks),
        "held": float(stats.held),
        "pending_admissions": float(stats.pending_admissions),
        "pid": float(os.getpid() if pid is None else pid),
    }
    return WorkerLoad(
        waiting=stats.waiting + stats.pending_admissions,
        running=stats.running,
        free_blocks=stats.free_blocks,
        extra=tuple(sorted(extra.items())),
    )


def _drain(engine: Any) -> list[KVCacheEvent]:
    return list(engine.kv.drain_events())


def _snapshot(engine: Any) -> CachedBlocks:
    engine.kv.drain_events()  # their effect is in the snapshot
    cached: CachedBlocks = engine.kv.cached_blocks()
    return cached


def engine_callbacks(
    engine: EngineRunner, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0
) -> tuple[StatsFn, DrainFn, SnapshotFn]:
    """``(stats_fn, drain_fn, snapshot_fn)`` for
    :func:`pdserve.cluster.worker_agent.start_worker_agent`.

    Call them from a thread other than ``loop``'s (the agent's). They raise TimeoutError
    after ``timeout_s`` and RuntimeError once the loop or the engine thread has stopped.
    """

    def call(coro_fn: Callable[[], Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro_fn(), loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def stats_fn() -> WorkerLoad:
        return load_from_stats(call(engine.stats))

    def drain_fn() -> Sequence[KVCacheEvent]:
        events: list[KVCacheEvent] = call(lambda: engine.run(_drain))
        return events

    def snapshot_fn() -> CachedBlocks:
        cached: CachedBlocks = call(lambda: engine.run(_snapshot))
        return cached

    return stats_fn, drain_fn, snapshot_fn
