"""Scale-in victim choice: which workers to remove so the cluster loses the least.

A worker's cost of removal, cheapest first:

1. ``unique_blocks``: cached KV blocks no other worker holds (the locality index's
   ``unique_blocks``); removing it turns later hits on those prefixes into recomputation;
2. ``running_requests``: work that must drain (or fail over) before it stops;
3. ``worker_id``: a deterministic tie-break.

A worker still starting holds nothing and runs nothing, so it goes first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from pdserve.cluster.autoscale.observations import WorkerObservation


def removal_cost(worker: WorkerObservation) -> tuple[int, int, str]:
    """Sort key: the smaller, the cheaper to remove."""
    return (worker.unique_blocks, worker.running_requests, worker.worker_id)


def choose_victims(workers: Iterable[WorkerObservation], count: int) -> tuple[str, ...]:
    """Ids of the ``count`` cheapest workers to remove, cheapest first.

    One pass with a heap of ``count`` entries: O(workers × log count), linear for the one
    or two replicas a decision removes.
    """
    if count <= 0:
        return ()
    return tuple(w.worker_id for w in heapq.nsmallest(count, workers, key=removal_cost))
