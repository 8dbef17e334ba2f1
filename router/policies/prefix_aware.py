"""Longest cached prefix first, guarded against piling every request on one hot worker."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.policies.base import OrderedPolicy, Ordering
from pdserve.router.policies.cost import Pools, load_key
from pdserve.router.policies.types import CostModel, RouteRequest, WorkerCandidate


class PrefixAwarePolicy(OrderedPolicy):
    """Prefill (or colocated) worker holding the longest prefix; decode worker least loaded.

    Hot-spot guard: a popular prefix would draw every request to the worker that holds it.
    A worker whose load exceeds the least-loaded one's by more than ``load_margin``
    requests is not chosen for its cache; it comes after the eligible workers.

    Among workers holding equally much of the prompt and running as many requests, the one
    given the least new prefix lately comes first: prefixes nobody holds spread evenly.
    """

    name = "prefix_aware"

    def __init__(self, cost: CostModel | None = None, load_margin: int = 4) -> None:
        if load_margin < 0:
            raise ValueError(f"load_margin must be >= 0 requests, got {load_margin}")
        super().__init__(cost)
        self._load_margin = load_margin

    def order(self, request: RouteRequest, pools: Pools) -> Ordering:
        return self.order_by_prefix(request, pools.prompt_pool), sorted(pools.decode, key=load_key)

    def order_by_prefix(
        self, request: RouteRequest, pool: Sequence[WorkerCandidate]
    ) -> list[WorkerCandidate]:
        """Eligible workers by cached prefix (longest first), then the overloaded ones."""
        least = min(w.load.requests for w in pool)
        limit = least + self._load_margin
        eligible = [w for w in pool if w.load.requests <= limit]
        hot = [w for w in pool if w.load.requests > limit]
        eligible.sort(
            key=lambda w: (
                -request.cached_tokens(w.worker_id),
                w.load.requests,
                request.new_blocks.get(w.worker_id, 0),
                *load_key(w),
            )
        )
        return eligible + sorted(hot, key=load_key)
