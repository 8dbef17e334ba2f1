"""The simulated cluster's workers: lifecycle (start-up, ready, drain, stop), the worker-hours
they cost, and per pool the routing heaps that yield the least-loaded workers quickly."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from pdserve.bench.autoscale_sim.model import CostModel
from pdserve.bench.autoscale_sim.workers import (
    DRAINING,
    READY,
    STARTING,
    STOPPED,
    ColocatedWorker,
    DecodeWorker,
    PrefillWorker,
    Worker,
)

ROLES = ("prefill", "decode", "colocated")
_KINDS: dict[str, type[Worker]] = {
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "colocated": ColocatedWorker,
}
Schedule = Callable[[float, int, object, int], None]


class Cluster:
    """Alive workers per role; ``on_ready`` is the event kind a start-up completes with."""

    def __init__(
        self,
        cost: CostModel,
        horizon: tuple[float, float],
        seed: int,
        schedule: Schedule,
        ready_kind: int,
    ) -> None:
        self.cost = cost
        self.start_s, self.horizon_s = horizon  # worker-hours count inside it
        self._rng = random.Random(f"startup:{seed}")
        self._schedule = schedule
        self._ready_kind = ready_kind
        self._ids = itertools.count()
        self.pools: dict[str, list[Worker]] = {role: [] for role in ROLES}
        self.worker_seconds = 0.0
        self.peak = 0
        self.peak_by_role = dict.fromkeys(ROLES, 0)
        self._heaps: dict[str, list[tuple[float, str, Worker]]] = {r: [] for r in ROLES}

    # lifecycle -------------------------------------------------------------------------
    def start(self, role: str, now: float, ready: bool = False) -> Worker:
        worker = _KINDS[role](f"{role}-{next(self._ids)}", role, now)
        self.pools[role].append(worker)
        self.peak = max(self.peak, sum(len(p) for p in self.pools.values()))
        self.peak_by_role[role] = max(self.peak_by_role[role], len(self.pools[role]))
        if ready:
            self.make_ready(worker, now)
        else:
            delay = self._rng.uniform(self.cost.startup_min_s, self.cost.startup_max_s)
            self._schedule(now + delay, self._ready_kind, worker, 0)
        return worker

    def make_ready(self, worker: Worker, now: float) -> None:
        if worker.state != STARTING:
            return  # cancelled while starting
        worker.state, worker.ready_s = READY, now
        if isinstance(worker, DecodeWorker):
            worker.last_s = now
        self.touch(worker)

    def drain(self, worker: Worker, now: float) -> bool:
        """Stop routing to it; True when it holds nothing and may stop now."""
        if worker.state == STARTING:
            return True
        worker.state = DRAINING
        if isinstance(worker, PrefillWorker):
            worker.prune(now)
            return not worker.jobs
        return isinstance(worker, DecodeWorker) and worker.idle

    def stop(self, worker: Worker, now: float) -> None:
        if worker.state == STOPPED:
            return
        worker.state, worker.stop_s = STOPPED, now
        self.pools[worker.role].remove(worker)
        self._account(worker, now)

    def close(self) -> None:
        """Charge every worker still up until the horizon."""
        for pool in self.pools.values():
            for worker in pool:
                self._account(worker, self.horizon_s)

    def _account(self, worker: Worker, end: float) -> None:
        begin = max(self.start_s, worker.ordered_s)
        self.worker_seconds += max(0.0, min(end, self.horizon_s) - begin)

    def count(self, role: str, *states: str) -> int:
        return sum(1 for w in self.pools[role] if not states or w.state in states)

    # routing heaps ----------------------------------------------------------------------
    def touch(self, worker: Worker) -> None:
        """Its load changed: index it under its new key."""
        if worker.state != READY:
            return
        heap = self._heaps[worker.role]
        heapq.heappush(heap, (_key(worker), worker.worker_id, worker))
        if len(heap) > 8 * len(self.pools[worker.role]) + 64:
            self._rebuild(worker.role)

    def least_loaded(self, role: str, k: int) -> list[Worker]:
        """The ``k`` ready workers with the least work (prefill: queued until; decode: KV
        reserved; colocated: KV reserved), each once."""
        heap = self._heaps[role]
        found: list[Worker] = []
        kept: list[tuple[float, str, Worker]] = []
        seen: set[str] = set()
        while heap and len(found) < k:
            entry = heapq.heappop(heap)
            key, wid, worker = entry
            if worker.state != READY or wid in seen or key != _key(worker):
                continue  # stale
            seen.add(wid)
            found.append(worker)
            kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)
        return found

    def _rebuild(self, role: str) -> None:
        heap = [(_key(w), w.worker_id, w) for w in self.pools[role] if w.state == READY]
        heapq.heapify(heap)
        self._heaps[role] = heap


def _key(worker: Worker) -> float:
    if isinstance(worker, PrefillWorker):
        return worker.busy_until
    assert isinstance(worker, DecodeWorker)
    return float(worker.reserved)


__all__ = ["DRAINING", "READY", "ROLES", "STARTING", "STOPPED", "Cluster"]
