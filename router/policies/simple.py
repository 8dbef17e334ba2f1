"""Round-robin and least-loaded: baselines that ignore the prefix cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdserve.router.policies.base import OrderedPolicy, Ordering
from pdserve.router.policies.cost import Pools, load_key
from pdserve.router.policies.types import CostModel, RouteRequest, WorkerCandidate


class RoundRobinPolicy(OrderedPolicy):
    """Takes workers in turn, one counter per pool, in worker-id order."""

    name = "round_robin"

    def __init__(self, cost: CostModel | None = None) -> None:
        super().__init__(cost)
        self._turns = itertools.count()

    def order(self, request: RouteRequest, pools: Pools) -> Ordering:
        turn = next(self._turns)  # one turn per routed request (rank skips empty fleets)
        return _rotate(pools.prompt_pool, turn), _rotate(pools.decode, turn)


class LeastLoadedPolicy(OrderedPolicy):
    """The worker with the fewest waiting + running requests (ties: less queued prefill)."""

    name = "least_loaded"

    def order(self, request: RouteRequest, pools: Pools) -> Ordering:
        return sorted(pools.prompt_pool, key=load_key), sorted(pools.decode, key=load_key)


def _rotate(workers: Sequence[WorkerCandidate], turn: int) -> list[WorkerCandidate]:
    ordered = sorted(workers, key=lambda w: w.worker_id)
    if not ordered:
        return ordered
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]
