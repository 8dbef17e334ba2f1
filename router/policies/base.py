"""What every policy shares: the pool split around ``rank``, and the order-then-pair ranking.

::

    rank(request, workers) ── no workers ──> []
        └─> rank_pools(request, split_pools(workers))
              PoolPolicy subclass (joint_ttft): scores every option itself
              OrderedPolicy subclass: order(request, pools) -> (prompt order, decode order)
                  └─> rank_pairs: first prompt worker x each decode worker, or each worker alone
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.policies.cost import Pools, describe, predict_ttft, split_pools
from pdserve.router.policies.types import CostModel, RouteDecision, RouteRequest, WorkerCandidate

Ordering = tuple[Sequence[WorkerCandidate], Sequence[WorkerCandidate]]


class PoolPolicy:
    """Base of every policy; ``rank`` is the ``RoutingPolicy`` protocol's."""

    name = "pool_policy"

    def __init__(self, cost: CostModel | None = None) -> None:
        self._cost = cost or CostModel()

    def rank(
        self, request: RouteRequest, workers: Sequence[WorkerCandidate]
    ) -> list[RouteDecision]:
        if not workers:
            return []
        return self.rank_pools(request, split_pools(workers))

    def rank_pools(self, request: RouteRequest, pools: Pools) -> list[RouteDecision]:
        """The decisions, best first, over a non-empty split of the workers."""
        raise NotImplementedError(f"{type(self).__name__} must define rank_pools()")


class OrderedPolicy(PoolPolicy):
    """A policy that only orders the pools; the pairing is :func:`rank_pairs`."""

    def rank_pools(self, request: RouteRequest, pools: Pools) -> list[RouteDecision]:
        prompt_order, decode_order = self.order(request, pools)
        return rank_pairs(self.name, request, pools, prompt_order, decode_order, self._cost)

    def order(self, request: RouteRequest, pools: Pools) -> Ordering:
        """``pools.prompt_pool`` (never empty) and ``pools.decode`` (empty when colocated),
        each best first."""
        raise NotImplementedError(f"{type(self).__name__} must define order()")


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
    est = predict_ttft(request, worker, None, cost)
    reason = f"{name}: colocated {describe(request, worker)}"
    return RouteDecision(
        worker.worker_id, None, est.total_s, name, reason,
        compute_tokens=est.compute_tokens, queue_s=est.queue_s,
    )  # fmt: skip


def pair(
    name: str,
    request: RouteRequest,
    prefill: WorkerCandidate,
    decode: WorkerCandidate,
    cost: CostModel,
) -> RouteDecision:
    est = predict_ttft(request, prefill, decode, cost)
    reason = f"{name}: prefill {describe(request, prefill)}, decode {describe(request, decode)}"
    return RouteDecision(
        prefill.worker_id, decode.worker_id, est.total_s, name, reason,
        compute_tokens=est.compute_tokens, queue_s=est.queue_s,
    )  # fmt: skip
