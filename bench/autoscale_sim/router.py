"""Routing through the router's real policy (``pdserve.router.policies``).

For each request the policy ranks a shortlist: the ``k`` least-loaded ready prefill workers
and the ``k`` least-loaded decode workers (colocated: every ready colocated worker). Without
a prefix cache in the model, ``joint_ttft`` scores a pair as prefill queue wait + decode
admission, each a function of one worker's own load, so its best pair is always in the
shortlist; the later decisions (where a refused reservation goes next) come from it too.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench.autoscale_sim.cluster import Cluster
from pdserve.bench.autoscale_sim.model import CostModel
from pdserve.bench.autoscale_sim.workers import (
    READY,
    ColocatedWorker,
    DecodeWorker,
    PrefillWorker,
    Worker,
)
from pdserve.proto.workers import WorkerLoad, WorkerRole
from pdserve.router.policies import (
    JointTtftPolicy,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerCandidate,
    make_policy,
)


class Router:
    """Ranks places for a request with the named policy (default ``joint_ttft``)."""

    def __init__(self, cost: CostModel, policy: str = "joint_ttft", shortlist: int = 2) -> None:
        self.cost = cost
        self.policy: RoutingPolicy = make_policy(policy, cost.router_cost())
        if isinstance(self.policy, JointTtftPolicy):  # only the head of its ranking is walked
            self.policy = JointTtftPolicy(cost.router_cost(), max_decisions=shortlist)
        self.shortlist = shortlist
        self.calls = 0

    def rank(
        self, cluster: Cluster, prompt_tokens: int, need_blocks: int, now: float
    ) -> tuple[list[RouteDecision], dict[str, Worker]]:
        """The policy's decisions, best first, and the workers they name; none when no
        decode worker could reserve ``need_blocks`` (the router would answer 429)."""
        if cluster.pools["colocated"]:
            workers: Sequence[Worker] = [w for w in cluster.pools["colocated"] if w.state == READY]
        else:
            decode = cluster.least_loaded("decode", self.shortlist)
            head = decode[0] if decode else None
            if not isinstance(head, DecodeWorker) or head.free_blocks(self.cost) < need_blocks:
                return [], {}  # the least-loaded refuses the reservation, so would all
            prefill = cluster.least_loaded("prefill", self.shortlist)
            workers = [*prefill, *decode] if prefill else []
        if not workers:
            return [], {}
        candidates = [self._candidate(w, now) for w in workers]
        self.calls += 1
        request = RouteRequest(prompt_tokens, self.cost.block_size)
        return self.policy.rank(request, candidates), {w.worker_id: w for w in workers}

    def _candidate(self, worker: Worker, now: float) -> WorkerCandidate:
        cost = self.cost
        if isinstance(worker, PrefillWorker):
            load = WorkerLoad(
                waiting=worker.waiting(now),
                running=worker.running(now),
                queued_prefill_tokens=worker.queued_tokens,
            )
            return WorkerCandidate(worker.worker_id, WorkerRole.PREFILL, load)
        assert isinstance(worker, DecodeWorker)
        if isinstance(worker, ColocatedWorker):
            load = WorkerLoad(
                waiting=len(worker.queued) + len(worker.prompts),
                running=worker.running,
                free_blocks=worker.free_blocks(cost),
                queued_prefill_tokens=worker.queued_prompt_tokens(),
            )
            return WorkerCandidate(worker.worker_id, WorkerRole.COLOCATED, load)
        load = WorkerLoad(
            waiting=len(worker.waiting),
            running=worker.running,
            free_blocks=worker.free_blocks(cost),
        )
        return WorkerCandidate(worker.worker_id, WorkerRole.DECODE, load)
