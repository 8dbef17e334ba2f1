"""Adapters that plug the Redis registry and locality index into the router.

- :class:`RedisWorkerDirectory` is the router's ``WorkerDirectory``: a background thread lists
  the live registrations every ``refresh_s``; ``live_workers()`` returns the last list at no
  cost. While Redis is unreachable the last list stays (workers usually outlive a Redis
  blip). After a Redis restart the registry is empty until each worker's next heartbeat
  re-registers it, so for one lease period workers seen before the restart stay listed.
- :class:`RedisLocality` is the router's ``LocalityIndex``: one Redis round trip per lookup;
  on a connection error it returns ``{}`` (routing falls back to load alone), logs once,
  and does not try Redis again for ``retry_s``.

The same thread sweeps index entries of lapsed workers and notices Redis restarts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis

from pdserve.cluster import registry as reg
from pdserve.cluster.locality_index import LocalityIndex
from pdserve.proto.workers import WorkerInfo
from pdserve.router.policies.types import PrefixHit

log = logging.getLogger("pdserve.router_wiring")

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


def merge_after_restart(
    current: Sequence[WorkerInfo], previous: Sequence[WorkerInfo]
) -> tuple[WorkerInfo, ...]:
    """Registered workers, plus those seen before a Redis restart that have not come back
    yet (pure). Registered entries win: they carry the fresh load."""
    ids = {w.worker_id for w in current}
    return tuple(current) + tuple(w for w in previous if w.worker_id not in ids)


class RedisWorkerDirectory:
    """``pdserve.router.state.directory.WorkerDirectory`` over the Redis registry, refreshed in a
    thread."""

    def __init__(
        self,
        registry: reg.WorkerRegistry,
        index: LocalityIndex,
        refresh_s: float = 0.25,
        sweep_s: float = 5.0,
    ) -> None:
        if refresh_s <= 0 or sweep_s <= 0:
            raise ValueError(f"refresh_s and sweep_s must be > 0, got {refresh_s}, {sweep_s}")
        self._registry = registry
        self._index = index
        self.refresh_s = refresh_s
        self.sweep_s = sweep_s
        self._live: tuple[WorkerInfo, ...] = ()
        self._keep_until_s = 0.0  # after a Redis restart: keep previous workers until then
        self._next_sweep_s = 0.0
        self._outage: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-directory", daemon=True)

    def live_workers(self) -> Sequence[WorkerInfo]:
        return self._live

    @property
    def redis_ok(self) -> bool:
        return self._outage is None

    def start(self) -> RedisWorkerDirectory:
        """One refresh now (so the first request sees the workers), then in the background."""
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def refresh(self) -> None:
        """List the registry once; keeps the last list on connection errors."""
        try:
            self._refresh()
        except _REDIS_DOWN as err:
            if self._outage is None:
                self._outage = repr(err)
                log.warning("Redis unreachable; routing to the last known workers: %r", err)
            return
        if self._outage is not None:
            log.warning("Redis reachable again (outage began with %s)", self._outage)
            self._outage = None

    def _refresh(self) -> None:
        now = time.monotonic()
        if self._index.check_restart():
            log.warning("Redis lost its data (restart?); workers re-register on heartbeat")
            self._keep_until_s = now + self._registry.lease_ms / 1000
        current = tuple(self._registry.list_workers())
        if now < self._keep_until_s:
            current = merge_after_restart(current, self._live)
        self._live = current
        if now >= self._next_sweep_s:
            self._next_sweep_s = now + self.sweep_s
            dropped = self._index.sweep()
            if dropped:
                log.info("locality index: dropped entries of %s", dropped)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()


class RedisLocality:
    """``pdserve.router.state.locality.LocalityIndex`` over the Redis index, with a load-only
    fallback."""

    def __init__(self, index: LocalityIndex, retry_s: float = 1.0) -> None:
        self._index = index
        self.retry_s = retry_s
        self._down_until_s = 0.0
        self._outage: str | None = None

    @property
    def redis_ok(self) -> bool:
        return self._outage is None

    def longest_prefix(
        self, block_hashes: Sequence[int | bytes], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHit]:
        return self.longest_prefix_many([(block_hashes, worker_ids)])[0]

    def longest_prefix_many(
        self, queries: Sequence[tuple[Sequence[int | bytes], Sequence[str]]]
    ) -> list[dict[str, PrefixHit]]:
        """One answer per query, in one round trip; all empty while Redis is down."""
        now = time.monotonic()
        if now < self._down_until_s:
            return [{} for _ in queries]
        try:
            answers = self._index.longest_prefix_many(queries)
        except _REDIS_DOWN as err:
            self._down_until_s = now + self.retry_s
            if self._outage is None:
                self._outage = repr(err)
                log.warning("locality index unreachable; routing on load alone: %r", err)
            return [{} for _ in queries]
        if self._outage is not None:
            log.warning("locality index reachable again; prefix-aware routing resumes")
            self._outage = None
        return answers
