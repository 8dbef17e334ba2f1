"""Round-robin and least-loaded: baselines that ignore the prefix cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.policies.cost import Pools, describe, load_key, predict_ttft, split_pools
from router.policies.types import CostModel, RouteDecision, RouteRequest, WorkerCandidate


def rank_pairs(
    name: str,
    request: RouteRequest,
    pools: Pools,
    prefill_order: Sequence[WorkerCandidate],
    decode_order: Sequence[WorkerCandidate],
    cost: CostModel,
) -> list[RouteDecision]:
    """The first prefill worker with each decode worker in turn; colocated: each worker.

    A refused reservation moves on to the next decode worker, keeping the chosen prefill.
    """
    if not pools.disaggregated:
        return [single(name, request, w, cost) for w in prefill_order]
    first = prefill_order[0]
    return [pair(name, request, first, d, cost) for d in decode_order]


def single(
    name: str, request: RouteRequest, worker: WorkerCandidate, cost: CostModel
) -> RouteDecision:
    ttft_s = predict_ttft(request, worker, None, cost).total_s
    reason = f"{name}: colocated {describe(request, worker)}"
    return RouteDecision(worker.worker_id, None, ttft_s, name, reason)


def pair(
    name: str,
    request: RouteRequest,
    prefill: WorkerCandidate,
    decode: WorkerCandidate,
    cost: CostModel,
) -> RouteDecision:
    ttft_s = predict_ttft(request, prefill, decode, cost).total_s
    reason = f"{name}: prefill {describe(request, prefill)}, decode {describe(request, decode)}"
    return RouteDecision(prefill.worker_id, decode.worker_id, ttft_s, name, reason)


class RoundRobinPolicy:
    """Takes workers in turn, one counter per pool, in worker-id order."""

    name = "round_robin"

    def __init__(self, cost: CostModel | None = None) -> None:
        self._cost = cost or CostModel()
        self._turns = itertools.count()

    def rank(
        self, request: RouteRequest, workers: Sequence[WorkerCandidate]
    ) -> list[RouteDecision]:
        if not workers:
            return []
        pools = split_pools(workers)
        turn = next(self._turns)
        first_pool = pools.prefill if pools.disaggregated else pools.colocated
        return rank_pairs(
            self.name,
            request,
            pools,
            _rotate(first_pool, turn),
            _rotate(pools.decode, turn),
            self._cost,
        )


class LeastLoadedPolicy:
    """The worker with the fewest waiting + running requests (ties: less queued prefill)."""

    name = "least_loaded"

    def __init__(self, cost: CostModel | None = None) -> None:
        self._cost = cost or CostModel()

    def rank(
        self, request: RouteRequest, workers: Sequence[WorkerCandidate]
    ) -> list[RouteDecision]:
        if not workers:
            return []
        pools = split_pools(workers)
        first_pool = pools.prefill if pools.disaggregated else pools.colocated
        return rank_pairs(
            self.name,
            request,
            pools,
            sorted(first_pool, key=load_key),
            sorted(pools.decode, key=load_key),
            self._cost,
        )


def _rotate(workers: Sequence[WorkerCandidate], turn: int) -> list[WorkerCandidate]:
    ordered = sorted(workers, key=lambda w: w.worker_id)
    if not ordered:
        return ordered
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]
